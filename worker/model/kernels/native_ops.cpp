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
 */
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>

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

}  // namespace

TORCH_LIBRARY(inflight_native, m) {
    m.def("lora_bind(Tensor weights, Tensor order, Tensor starts, Tensor slots, int tokens, int threads, "
          "int kernel) -> ()",
          &lora_bind);
    m.def("lora_bind_torch() -> ()", &lora_bind_torch);
    m.def("lora_unbind() -> ()", &lora_unbind);
    m.def("lora_delta(Tensor x, Tensor(a!) y, int projection) -> ()");
}

TORCH_LIBRARY_IMPL(inflight_native, CPU, m) { m.impl("lora_delta", &lora_delta); }
