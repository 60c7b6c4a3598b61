/* The CPU kernels' per-call side as torch operators written in C++ (`native.py` builds and
 * loads this file): an operator implemented in Python pays the dispatcher's trip into the
 * interpreter, the Python body's checks and a ctypes call, 6-8 us a call on these boxes,
 * where the work of a decode step's call is itself a few microseconds. Implemented here, a
 * call from a compiled graph or from Python costs about 3 us in all.
 *
 * inflight_native::lora_delta(x, y, projection)
 *     The adapters' delta of one projection added to y in place, by the SGMV kernel of
 *     `cpu_lora.c`, whose address the step's binding gives. The step's grouping and the
 *     weight buffers' arguments are bound once per step for the calling thread
 *     (`lora_bind`), as `worker.model.lora.lora_step` sets the Python side's step; a call
 *     in a thread with no step bound adds nothing; a call the kernel cannot take (no
 *     kernel bound, or tensors of another shape, dtype, device or layout) goes to
 *     `inflight::lora_delta`, the torch path, which reads the same step. The binding holds
 *     the grouping's index tensors and the weight table, not the weight buffers whose
 *     addresses the table carries: the caller keeps them for as long as the binding
 *     stands (`LoRAWeights` lives with its engine, and `lora_step` unbinds when its step
 *     ends). `lora_bind` calls whatever address it is given: an internal operator.
 *
 * inflight_native::attention(query, key, value, layer, scaling, sliding_window, softcap, sinks, v_head_dim)
 *     `inflight::attention`'s contract for a step whose every token is a row of the decode
 *     kernel (decodes, and short chunks whose tokens each read their context up to
 *     themselves): the layer's K/V copied into its cache slots, then `cpu_decode.c`'s
 *     kernel over the rows' block tables, with no Python in the call. The step (its slots,
 *     a block table and a context length per token, the kernel's address, each layer's
 *     caches) is bound once per step for the calling thread (`attention_bind`, by
 *     `worker.model.attention.native_attention_step`), checked against the caches'
 *     geometry there. A call the
 *     binding does not cover goes to `inflight::attention`, which reads the same step from
 *     Python: no step bound, a layer bound without caches (int8 caches, ALiBi, latent
 *     attention), soft-capping or sinks, or tensors of another shape, dtype or device.
 *     The binding holds its tensors; `attention_bind` calls whatever address it is given.
 */
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using SgmvFn = int (*)(const float *, int64_t, float *, int64_t, const float *, const float *, const int64_t *,
                       const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t);

constexpr int64_t kWeightFields = 5;  // per projection: in, out, a's address, b's address, rank

struct LoraStep {
    bool active = false;   // a step with adapters is running in this thread
    SgmvFn fn = nullptr;   // the kernel, or none: every call takes the torch path
    at::Tensor weights;    // [projections, 5] int64 (held: the op reads it)
    at::Tensor order, starts, slots;  // the grouping's index tensors (held: the kernel reads them)
    int64_t segments = 0, tokens = 0, threads = 1;
};

thread_local LoraStep current;

void check_index(const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.scalar_type() == at::kLong && t.device().is_cpu() && t.is_contiguous() && t.dim() == 1,
                "lora_bind: ", name, " must be a contiguous 1-d int64 CPU tensor");
}

void lora_bind(const at::Tensor &weights, const at::Tensor &order, const at::Tensor &starts, const at::Tensor &slots,
               int64_t tokens, int64_t threads, int64_t kernel) {
    TORCH_CHECK(weights.scalar_type() == at::kLong && weights.device().is_cpu() && weights.is_contiguous() &&
                    weights.dim() == 2 && weights.size(1) == kWeightFields,
                "lora_bind: weights must be a contiguous [projections, 5] int64 CPU tensor");
    check_index(order, "order");
    check_index(starts, "starts");
    check_index(slots, "slots");
    TORCH_CHECK(starts.numel() == slots.numel() + 1, "lora_bind: starts must hold one more entry than slots");
    TORCH_CHECK(kernel != 0 && tokens >= 0 && threads >= 1, "lora_bind: kernel, tokens or threads out of range");
    LoraStep s;
    s.active = true;
    s.fn = reinterpret_cast<SgmvFn>(kernel);
    s.weights = weights;
    s.order = order;
    s.starts = starts;
    s.slots = slots;
    s.segments = slots.numel();
    s.tokens = tokens;
    s.threads = threads;
    current = std::move(s);
}

void lora_bind_torch() {
    current = LoraStep{};
    current.active = true;
}

void lora_unbind() { current = LoraStep{}; }

bool kernel_takes(const at::Tensor &x, const at::Tensor &y, const int64_t *w) {
    const LoraStep &s = current;
    return x.dim() == 2 && y.dim() == 2 && x.size(0) == s.tokens && y.size(0) == s.tokens && x.size(1) == w[0] &&
           y.size(1) == w[1] && x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
           x.device().is_cpu() && y.device().is_cpu() && x.stride(1) == 1 && y.stride(1) == 1;
}

void lora_delta(const at::Tensor &x, const at::Tensor &y, int64_t projection) {
    const LoraStep &s = current;
    if (!s.active) return;
    if (s.fn != nullptr && projection >= 0 && projection < s.weights.size(0)) {
        const int64_t *w = s.weights.data_ptr<int64_t>() + kWeightFields * projection;
        if (kernel_takes(x, y, w)) {
            const int status = s.fn(x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), y.stride(0),
                                    reinterpret_cast<const float *>(w[2]), reinterpret_cast<const float *>(w[3]),
                                    s.order.data_ptr<int64_t>(), s.starts.data_ptr<int64_t>(),
                                    s.slots.data_ptr<int64_t>(), s.segments, w[0], w[1], w[4], s.threads);
            TORCH_CHECK(status == 0, "inflight_lora_sgmv returned ", status, " (1: rank out of range, 2: no vector path)");
            return;
        }
    }
    static const auto torch_path = c10::Dispatcher::singleton()
                                       .findSchemaOrThrow("inflight::lora_delta", "")
                                       .typed<void(const at::Tensor &, const at::Tensor &, int64_t)>();
    torch_path.call(x, y, projection);
}


/* ---- paged decode attention ------------------------------------------------------------ */

using DecodeFn = int (*)(const float *, const float *, const float *, const int32_t *, const int32_t *, float *,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int64_t, float, int64_t, int64_t);

struct AttentionStep {
    DecodeFn fn = nullptr;  // the kernel; none bound: every call takes the Python path
    std::vector<at::Tensor> k_caches, v_caches;  // per layer; an empty tensor: that layer takes the Python path
    at::Tensor slots, tables, seq_lens;  // [tokens] int64, [tokens, max_blocks] int32, [tokens] int32
    int64_t threads = 1;
};

thread_local AttentionStep attention_step;

bool cache_ok(const at::Tensor &c) {
    return c.dim() == 4 && c.scalar_type() == at::kFloat && c.device().is_cpu() && c.stride(3) == 1;
}

/* Every slot inside the cache (or negative: not written), every block id a block of it,
 * every context within its row's table: what the kernel and the writes trust. */
void check_geometry(const at::Tensor &slots, const at::Tensor &tables, const at::Tensor &seq_lens, int64_t num_blocks,
                    int64_t block_size) {
    const int64_t tokens = slots.numel(), width = tables.size(1);
    const int64_t *slot = slots.data_ptr<int64_t>();
    const int32_t *len = seq_lens.data_ptr<int32_t>();
    for (int64_t t = 0; t < tokens; t++) {
        TORCH_CHECK(slot[t] < num_blocks * block_size, "attention_bind: slot ", slot[t], " outside the cache");
        TORCH_CHECK(len[t] >= 0 && len[t] <= width * block_size, "attention_bind: context ", len[t],
                    " outside its block table");
        const int32_t *row = tables.data_ptr<int32_t>() + t * tables.stride(0);
        for (int64_t b = 0; b < width; b++)
            TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, "attention_bind: block ", row[b], " outside the cache");
    }
}

void attention_bind(const std::vector<at::Tensor> &k_caches, const std::vector<at::Tensor> &v_caches,
                    const at::Tensor &slots, const at::Tensor &tables, const at::Tensor &seq_lens, int64_t threads,
                    int64_t kernel) {
    TORCH_CHECK(k_caches.size() == v_caches.size(), "attention_bind: one value cache per key cache");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.device().is_cpu() && slots.is_contiguous() && slots.dim() == 1,
                "attention_bind: slots must be a contiguous 1-d int64 CPU tensor");
    const int64_t tokens = slots.numel();
    TORCH_CHECK(tables.scalar_type() == at::kInt && tables.device().is_cpu() && tables.dim() == 2 &&
                    tables.size(0) == tokens && tables.stride(1) == 1,
                "attention_bind: tables must be a [tokens, blocks] int32 CPU tensor with contiguous rows");
    TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.device().is_cpu() && seq_lens.is_contiguous() &&
                    seq_lens.numel() == tokens,
                "attention_bind: seq_lens must be a contiguous [tokens] int32 CPU tensor");
    TORCH_CHECK(kernel != 0 && threads >= 1, "attention_bind: kernel or threads out of range");
    AttentionStep s;
    s.fn = reinterpret_cast<DecodeFn>(kernel);
    for (size_t i = 0; i < k_caches.size(); i++) {
        const bool ok = k_caches[i].numel() > 0 && cache_ok(k_caches[i]) && cache_ok(v_caches[i]) &&
                        k_caches[i].sizes().slice(0, 3) == v_caches[i].sizes().slice(0, 3);
        s.k_caches.push_back(ok ? k_caches[i] : at::Tensor());
        s.v_caches.push_back(ok ? v_caches[i] : at::Tensor());
    }
    for (const at::Tensor &c : s.k_caches) {  // the caches share their geometry: check the step against it once
        if (!c.defined()) continue;
        check_geometry(slots, tables, seq_lens, c.size(0), c.size(1));
        break;
    }
    s.slots = slots;
    s.tables = tables;
    s.seq_lens = seq_lens;
    s.threads = threads;
    attention_step = std::move(s);
}

void attention_unbind() { attention_step = AttentionStep{}; }

/* `src` [1, heads, tokens, dim] (transformers' layout, any strides but a unit last one) ->
 * `dst` [tokens, heads, dim] contiguous */
void to_token_major(const at::Tensor &src, float *dst) {
    const int64_t heads = src.size(1), tokens = src.size(2), dim = src.size(3);
    const float *base = src.data_ptr<float>();
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++)
            std::memcpy(dst + (t * heads + h) * dim, base + h * src.stride(1) + t * src.stride(2), sizeof(float) * dim);
}

/* token t's [heads, dim] of `src` [1, heads, tokens, dim] into slot slots[t] of `cache`
 * [blocks, block_size, heads, dim]; negative slots (a decode graph's padding rows) skipped */
void write_cache(const at::Tensor &src, const at::Tensor &cache, const int64_t *slots) {
    const int64_t heads = src.size(1), tokens = src.size(2), dim = src.size(3), bs = cache.size(1);
    const int64_t limit = cache.size(0) * bs;
    const float *base = src.data_ptr<float>();
    float *out = cache.data_ptr<float>();
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= limit) continue;  // checked at the binding: only padding rows are skipped
        float *row = out + (slot / bs) * cache.stride(0) + (slot % bs) * cache.stride(1);
        for (int64_t h = 0; h < heads; h++)
            std::memcpy(row + h * cache.stride(2), base + h * src.stride(1) + t * src.stride(2), sizeof(float) * dim);
    }
}

bool decode_takes(const AttentionStep &s, int64_t layer, const at::Tensor &q, const at::Tensor &k,
                  const at::Tensor &v, double softcap, const std::optional<at::Tensor> &sinks, int64_t v_head_dim) {
    if (s.fn == nullptr || softcap != 0.0 || sinks.has_value() || layer < 0 ||
        layer >= static_cast<int64_t>(s.k_caches.size()) || !s.k_caches[layer].defined())
        return false;
    const at::Tensor &kc = s.k_caches[layer], &vc = s.v_caches[layer];
    const int64_t tokens = s.slots.numel();
    for (const at::Tensor *t : {&q, &k, &v})
        if (t->dim() != 4 || t->size(0) != 1 || t->size(2) != tokens || t->scalar_type() != at::kFloat ||
            !t->device().is_cpu() || (t->stride(3) != 1 && t->size(3) != 1))
            return false;
    return k.size(1) == kc.size(2) && v.size(1) == kc.size(2) && k.size(3) == kc.size(3) && v.size(3) == vc.size(3) &&
           v_head_dim == vc.size(3) && q.size(1) % kc.size(2) == 0 && q.size(3) == kc.size(3);
}

at::Tensor attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, int64_t layer,
                     double scaling, int64_t sliding_window, double softcap, const std::optional<at::Tensor> &sinks,
                     int64_t v_head_dim) {
    const AttentionStep &s = attention_step;
    if (decode_takes(s, layer, query, key, value, softcap, sinks, v_head_dim)) {
        const at::Tensor &kc = s.k_caches[layer], &vc = s.v_caches[layer];
        const int64_t tokens = s.slots.numel(), heads = query.size(1), dim = query.size(3);
        write_cache(key, kc, s.slots.data_ptr<int64_t>());
        write_cache(value, vc, s.slots.data_ptr<int64_t>());
        at::Tensor q = at::empty({tokens, heads, dim}, query.options());
        to_token_major(query, q.data_ptr<float>());
        at::Tensor out = at::empty({1, tokens, heads, v_head_dim}, query.options());
        const int status = s.fn(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                                s.tables.data_ptr<int32_t>(), s.seq_lens.data_ptr<int32_t>(), out.data_ptr<float>(),
                                tokens, s.tables.stride(0), heads, kc.size(2), dim, v_head_dim, kc.size(1),
                                kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
                                static_cast<float>(scaling), sliding_window, s.threads);
        TORCH_CHECK(status == 0, "inflight_paged_decode returned ", status, " (1: no scratch memory)");
        return out;
    }
    static const auto python_path =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("inflight::attention", "")
            .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t, double, int64_t,
                              double, const std::optional<at::Tensor> &, int64_t)>();
    return python_path.call(query, key, value, layer, scaling, sliding_window, softcap, sinks, v_head_dim);
}

}  // namespace

TORCH_LIBRARY(inflight_native, m) {
    m.def("lora_bind(Tensor weights, Tensor order, Tensor starts, Tensor slots, int tokens, int threads, "
          "int kernel) -> ()",
          &lora_bind);
    m.def("lora_bind_torch() -> ()", &lora_bind_torch);
    m.def("lora_unbind() -> ()", &lora_unbind);
    m.def("lora_delta(Tensor x, Tensor(a!) y, int projection) -> ()");
    m.def("attention_bind(Tensor[] k_caches, Tensor[] v_caches, Tensor slots, Tensor tables, Tensor seq_lens, "
          "int threads, int kernel) -> ()",
          &attention_bind);
    m.def("attention_unbind() -> ()", &attention_unbind);
    m.def("attention(Tensor query, Tensor key, Tensor value, int layer, float scaling, int sliding_window, "
          "float softcap, Tensor? sinks, int v_head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(inflight_native, CPU, m) {
    m.impl("lora_delta", &lora_delta);
    m.impl("attention", &attention);
}
