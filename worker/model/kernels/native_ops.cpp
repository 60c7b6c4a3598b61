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
 *     `inflight::lora_delta`, the torch path, which reads the same step.
 *
 * inflight_native::float_linear(x, weight, bias) -> y
 *     `inflight::float_linear`'s contract (`worker.model.small_batch`): `F.linear` by the
 *     method the weight's plan names for this many rows (torch's GEMM, the small-batch
 *     kernel of `cpu_woq.c`, or the weight's oneDNN-packed copy). The plans are registered
 *     per weight tensor (`linear_plan`, by `small_batch.install`) in a table keyed by the
 *     tensor, holding it weakly: a weight without a plan (or whose tensor died) is
 *     multiplied by torch's GEMM, as the Python operator does for a weight without
 *     `inflight_plan`. A registration drops the plans of weights that died (with their
 *     packed copies); `linear_plan_count` says how many the table holds.
 */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
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

// ---- float_linear ---------------------------------------------------------------------------

using FloatLinearFn = int (*)(const float *, const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t);

constexpr int64_t kTorch = 0, kKernel = 1, kPacked = 2;  // small_batch's TORCH, KERNEL, PACKED
constexpr int64_t kBuckets = 7;                          // rows 1, 2, 3-4, 5-8, 9-16, 17-32, more

struct LinearPlan {
    explicit LinearPlan(const at::Tensor &w) : weight(w.getIntrusivePtr()) {}
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> weight;
    std::array<int64_t, kBuckets> how{};
    at::Tensor packed;  // the weight in oneDNN's layout, or undefined
    FloatLinearFn kernel = nullptr;
};

std::shared_mutex plans_mutex;
std::unordered_map<const c10::TensorImpl *, LinearPlan> plans;

void linear_plan(const at::Tensor &weight, at::IntArrayRef how, const std::optional<at::Tensor> &packed,
                 int64_t kernel) {
    TORCH_CHECK(static_cast<int64_t>(how.size()) == kBuckets, "linear_plan: a plan has ", kBuckets, " methods, got ",
                how.size());
    LinearPlan plan(weight);
    for (int64_t i = 0; i < kBuckets; i++) {
        TORCH_CHECK(how[i] == kTorch || how[i] == kKernel || how[i] == kPacked, "linear_plan: method ", how[i],
                    " is none of 0 (torch), 1 (kernel), 2 (oneDNN)");
        TORCH_CHECK(how[i] != kKernel || kernel != 0, "linear_plan: a plan using the kernel needs its address");
        TORCH_CHECK(how[i] != kPacked || (packed.has_value() && packed->defined()),
                    "linear_plan: a plan using oneDNN needs the packed weight");
        plan.how[i] = how[i];
    }
    if (packed.has_value()) plan.packed = *packed;
    plan.kernel = reinterpret_cast<FloatLinearFn>(kernel);
    std::unique_lock lock(plans_mutex);
    for (auto it = plans.begin(); it != plans.end();) {  // the plans of weights that died, and their packed copies
        it = it->second.weight.expired() ? plans.erase(it) : std::next(it);
    }
    plans.insert_or_assign(weight.unsafeGetTensorImpl(), std::move(plan));
}

int64_t linear_plan_count() {
    std::shared_lock lock(plans_mutex);
    return static_cast<int64_t>(plans.size());
}

int64_t bucket(int64_t rows) {
    int64_t bits = 0;
    for (int64_t r = rows - 1; r > 0; r >>= 1) bits++;
    return bits < kBuckets - 1 ? bits : kBuckets - 1;
}

std::vector<int64_t> out_shape(const at::Tensor &x, int64_t n) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(n);
    return shape;
}

at::Tensor float_linear(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2, "float_linear: x [..., in_features], weight [out_features, in]");
    const int64_t k = x.size(-1), n = weight.size(0);
    const int64_t rows = k ? x.numel() / k : 0;
    int64_t how = kTorch;
    at::Tensor packed;
    FloatLinearFn kernel = nullptr;
    {
        std::shared_lock lock(plans_mutex);
        const auto it = plans.find(weight.unsafeGetTensorImpl());
        if (it != plans.end() && !it->second.weight.expired()) {
            how = rows ? it->second.how[bucket(rows)] : kTorch;
            packed = it->second.packed;
            kernel = it->second.kernel;
        }
    }
    const bool float_cpu = x.scalar_type() == at::kFloat && x.device().is_cpu();
    const at::Tensor *b = bias.has_value() && bias->defined() ? &*bias : nullptr;
    if (how == kKernel && float_cpu && weight.size(1) == k && weight.is_contiguous() &&
        weight.scalar_type() == at::kFloat && (b == nullptr || (b->size(0) == n && b->is_contiguous()))) {
        // a bias is checked here: layers sharing one weight share its plan but not their biases
        const at::Tensor xc = x.contiguous();
        at::Tensor y = at::empty(out_shape(x, n), x.options());
        const int status = kernel(xc.data_ptr<float>(), weight.data_ptr<float>(),
                                  b == nullptr ? nullptr : b->data_ptr<float>(), y.data_ptr<float>(), rows, k, n,
                                  at::get_num_threads());
        TORCH_CHECK(status == 0, "inflight_float_linear returned ", status);
        return y;
    }
    if (packed.defined() && (how == kPacked || weight.size(1) != k)) {
        if (float_cpu) {
            if (rows == 0) return at::empty(out_shape(x, n), x.options());
            static const auto onednn = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
            std::vector<c10::IValue> stack{x.reshape({rows, k}).contiguous(), packed,
                                           b == nullptr ? c10::IValue() : c10::IValue(*b), std::string("none"),
                                           c10::List<std::optional<at::Scalar>>(), std::optional<std::string>()};
            onednn.callBoxed(&stack);
            return stack[0].toTensor().view(out_shape(x, n));
        }
        TORCH_CHECK(weight.size(1) == k, "a linear layer held only in oneDNN's packed layout takes float32 CPU rows, got ",
                    x.scalar_type(), " on ", x.device());
    }
    return at::linear(x, weight, bias);
}

}  // namespace

TORCH_LIBRARY(inflight_native, m) {
    m.def("lora_bind(Tensor weights, Tensor order, Tensor starts, Tensor slots, int tokens, int threads, "
          "int kernel) -> ()",
          &lora_bind);
    m.def("lora_bind_torch() -> ()", &lora_bind_torch);
    m.def("lora_unbind() -> ()", &lora_unbind);
    m.def("lora_delta(Tensor x, Tensor(a!) y, int projection) -> ()");
    m.def("linear_plan(Tensor weight, int[] how, Tensor? packed, int kernel) -> ()", &linear_plan);
    m.def("linear_plan_count() -> int", &linear_plan_count);
    m.def("float_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(inflight_native, CPU, m) {
    m.impl("lora_delta", &lora_delta);
    m.impl("float_linear", &float_linear);
}
