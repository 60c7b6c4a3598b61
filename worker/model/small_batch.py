"""Float32 linear layers on the CPU: torch's GEMM, a small-batch C kernel, or oneDNN's
pre-packed weights, chosen per weight shape and row count by timing them at load.

Three ways to multiply a float32 weight by a step's rows:

- torch's GEMM (`F.linear`; MKL's `sgemm` in torch's x86 builds);
- the C kernel of the weight-only layers (`kernels/cpu_woq.c`, `inflight_float_linear`:
  register tiles over float weights, the output channels split over torch's threads),
  for up to `MAX_ROWS` rows;
- the weight packed once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, multiplied by `mkldnn._linear_pointwise`:
  the kernels Inductor's freezing uses, as vLLM's CPU build packs its weights).

Which is fastest depends on the box, not only on the shapes: on the AMD EPYC benchmark
box (AVX-512, where MKL does not take its AVX-512 paths) the kernel won at 1-8 rows and
oneDNN above (a decode step of 32 requests 1.1-1.3x, ~160M model 1.88x); on an Intel Xeon
with AVX-512, MKL's GEMM beat both at 2-32 rows and the op's own Python call (~8 us a
layer) lost the kernel's lead at 1 row: the same rule made a decode step 0.79-0.94x as
fast (docs/benchmarks.md). So `install` times the three on one weight of each shape at
`PROBE_ROWS`, with torch's threads as the engine runs, each candidate as the layer would
call it (torch's GEMM direct, the others through the op), and takes another path than
torch's only for row counts where it is at least `MIN_GAIN` times faster (policy `auto`,
`model.cpu_linear`). A layer whose every row count stays on torch's GEMM stays the
`nn.Linear` it was, with no op around it; a packed copy is kept only where oneDNN serves
some row count. `inflight` is the fixed rule measured on the AMD box (the kernel up to
`PACKED_KERNEL_ROWS` rows with one torch thread, `MAX_ROWS` with more; oneDNN above),
`torch` leaves every layer alone. The plans `auto` times are kept per box and read at
every later start (`worker.model.linear_plans`): a captured forward's key depends on them,
and timed again they could differ by noise where two paths are close.

The choice rides on the weight tensor as its plan (`weight.inflight_plan`, a method per
row bucket: rows 1, 2, 3-4, 5-8, 9-16, 17-32, more), beside its packed copy
(`weight.inflight_packed`): a compiled forward takes the parameters as inputs, so two
models sharing one graph each multiply their own weights by their own plans. Row counts
between probes take the plan of the next probe up, past the last the last's; the plan is
made with the thread count at load (an engine that later gains or loses threads keeps it).

Memory: a weight larger than `PLAIN_COPY_BYTES` is never given to the op in its plain
layout (a large plain weight under this op is what crashed a captured forward:
docs/limits.md, Performance): it is either held packed only (its `weight` an
`[out_features, 0]` placeholder, so memory stays as before; oneDNN at every row count)
where oneDNN is faster over the probes together (geometric mean, `MIN_GAIN`), or left
as an `nn.Linear`. A module marked `inflight_reads_weight` (a wrapper that reads the
weight itself: `latent.py`, `legacy.py`) keeps its plain weight: a large one stays an
`nn.Linear`.

The op `torch.ops.inflight.float_linear` is declared with `torch.library.Library` (a
call costs about 2 us against 4 us for `custom_op`, `worker.model.lora`); a compiled
forward keeps it as one opaque node, as it keeps torch's GEMM (an extern call). Sums run
in another order than torch's GEMM: results differ in the last bits, as a compiled
forward's do from an eager one, and two workers whose timings chose differently may
differ so too (`cpu_linear: inflight` or `torch` fixes the choice).
"""

from __future__ import annotations

import functools
import logging
import math
import time

import torch
import torch.nn.functional as F

from worker.model.kernels import cpu_woq
from worker.model.linear_plans import PlanCache

log = logging.getLogger(__name__)

POLICIES = ("auto", "inflight", "torch")  # `model.cpu_linear`
TORCH, KERNEL, PACKED = 0, 1, 2  # a plan's methods
METHOD_NAMES = ("torch", "kernel", "oneDNN")
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)  # one per row bucket: rows 1, 2, 3-4, 5-8, 9-16, 17-32, more
LAST_BUCKET = len(PROBE_ROWS) - 1
MAX_ROWS = 8  # rows up to which the kernel takes a product (measured faster than torch's GEMM on the AMD box)
PACKED_KERNEL_ROWS = 2  # ...and than oneDNN's packed product when torch has one thread (the `inflight` rule)
PACK_ROWS_HINT = 32  # the row count oneDNN lays a packed weight out for (any count is multiplied)
PLAIN_COPY_BYTES = 2 << 20  # a weight up to this size keeps its plain layout beside the packed one
MIN_GAIN = 1.05  # another path than torch's GEMM is taken where timed at least this much faster
PROBE_BUDGET_S = 0.03  # timing rounds per shape continue while they have taken less than this (2 to 15 rounds)

_LIB = torch.library.Library("inflight", "FRAGMENT")
_LIB.define("float_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`torch.ops.inflight.float_linear`: `F.linear(x, weight, bias)` by the method the
    weight's plan (`weight.inflight_plan`, made by `install`) names for this many rows:
    torch's GEMM, the CPU kernel, or the weight's oneDNN-packed copy
    (`weight.inflight_packed`). A weight without a plan is multiplied by torch's GEMM.

    Args:
        x: `[..., in_features]`; weight: `[out_features, in_features]`, or a packed-only
            layer's `[out_features, 0]` placeholder; bias: `[out_features]` or None.

    Returns:
        `[..., out_features]` in `x`'s dtype.

    Raises:
        RuntimeError: the kernel failed (it returns 0 for every operand `install` plans it
            for), or `weight` is a packed-only layer's placeholder and `x` is no float32
            CPU tensor.
    """
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    plan = getattr(weight, "inflight_plan", None)
    how = plan[min((rows - 1).bit_length(), LAST_BUCKET)] if plan is not None and rows else TORCH
    if (how == KERNEL and x.dtype == torch.float32 and x.is_cpu and weight.shape[1] == k
            and (bias is None or (bias.shape[0] == weight.shape[0] and bias.is_contiguous()))):
        # the weight's side was checked by `install`; a bias is checked here, since layers
        # sharing one weight share its plan but not their biases
        y = torch.empty(x.shape[:-1] + weight.shape[:1], dtype=torch.float32)  # no views: ~1 us each a call
        status = cpu_woq.float_linear(x if x.is_contiguous() else x.contiguous(), weight, bias, y)
        if status != 0:
            raise RuntimeError(f"inflight_float_linear returned {status}")
        return y
    packed = getattr(weight, "inflight_packed", None)
    if packed is not None and (how == PACKED or weight.shape[-1] != k):
        if x.dtype == torch.float32 and x.is_cpu:
            if rows == 0:
                return x.new_empty(*x.shape[:-1], weight.shape[0])
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, k).contiguous(), packed, bias, "none", [], "")
            return y.view(*x.shape[:-1], weight.shape[0])
        if weight.shape[-1] != k:
            raise RuntimeError(f"a linear layer held only in oneDNN's packed layout takes float32 CPU rows, got "
                               f"{x.dtype} on {x.device}")
    return F.linear(x, weight, bias)


@functools.cache
def _width() -> int:
    return cpu_woq.vector_width()


_LIB.impl("float_linear", float_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("inflight::float_linear", lib=_LIB)
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class SmallBatchLinear(torch.nn.Linear):
    """An `nn.Linear` whose forward is `torch.ops.inflight.float_linear` (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.inflight.float_linear(x, self.weight, self.bias)


def install(model: torch.nn.Module, plain_copy_bytes: int | None = None, policy: str = "auto") -> int:
    """Choose, for every float32 CPU `nn.Linear` of `model` (exactly that class: quantized
    layers and others are left), how its products are computed (module docstring), and
    make the layers that take another path than torch's GEMM somewhere a
    `SmallBatchLinear` with their plan, in place. `plain_copy_bytes` (default
    `PLAIN_COPY_BYTES`): weights above it are held packed only or left alone. `policy`:
    `auto` (timed on this box, at the first start: the plans are kept,
    `worker.model.linear_plans`), `inflight` (the fixed rule) or `torch` (none). Returns
    how many layers changed class.

    Raises:
        ValueError: `policy` is none of `POLICIES`.
    """
    if policy not in POLICIES:
        raise ValueError(f"model.cpu_linear must be one of {list(POLICIES)}, got {policy!r}")
    layers = [m for m in model.modules()
              if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    if policy == "torch" or not layers:
        return 0
    limit = PLAIN_COPY_BYTES if plain_copy_bytes is None else plain_copy_bytes
    width = _width()  # 0: no vector tiles (or no kernel)
    packable = torch.backends.mkldnn.is_available()
    start, plans, n, timed = time.perf_counter(), {}, 0, 0
    cache = PlanCache.for_this_box(packable) if policy == "auto" else None
    for m in layers:
        large = m.weight.numel() * m.weight.element_size() > limit
        if large and getattr(m, "inflight_reads_weight", False):
            continue  # a large weight that must stay plain stays an `nn.Linear` (module docstring)
        if policy == "inflight" and not (width and m.in_features % width == 0):
            continue  # the fixed rule took only layers the kernel's vectors fit (oneDNN above them)
        kernel = not large and bool(width) and _kernel_takes(m, width)
        key = (m.out_features, m.in_features, m.bias is not None, large, kernel)
        packed = None
        if key not in plans:  # the timed layer's packed copy serves it: its weight is packed once
            if policy == "inflight":
                plans[key] = _fixed_plan(large, kernel, packable)
            else:
                kept, plans[key] = cache.get(key)
                if not (kept and _plan_fits(plans[key], large, kernel)):
                    plans[key], packed = _timed_plan(m, large, kernel, packable)
                    cache.put(key, plans[key])
                    timed += 1
        if plans[key] is not None and _apply(m, plans[key], large, packed):
            n += 1
    if policy == "auto":
        cache.save()
    if n or policy == "auto":
        shapes = "; ".join(f"{out}x{k}: {describe(p)}" for (out, k, *_), p in plans.items())
        how = (f"{timed} of {len(plans)} shapes timed in {time.perf_counter() - start:.2f} s, the rest kept"
               if policy == "auto" else "the fixed rule")
        log.info("float32 linear layers: %d of %d take the op (cpu_linear %s, %d torch threads, %s; plans kept in %s): "
                 "%s", n, len(layers), policy, torch.get_num_threads(), how,
                 cache.path if policy == "auto" else "-", shapes)
    return n


def describe(plan: tuple[int, ...] | None) -> str:
    """A plan in words, e.g. `rows 1: kernel, 2-8: torch, 9+: oneDNN` (None: torch's GEMM)."""
    if plan is None:
        return "torch"
    parts, lo = [], 1
    for i, how in enumerate(plan):
        hi = PROBE_ROWS[i]
        if i + 1 < len(plan) and plan[i + 1] == how:
            continue
        span = f"{lo}+" if i == LAST_BUCKET else (f"{lo}" if lo == hi else f"{lo}-{hi}")
        parts.append(f"{span}: {METHOD_NAMES[how]}")
        lo = hi + 1
    return "rows " + ", ".join(parts)


def _kernel_takes(m: torch.nn.Linear, width: int) -> bool:
    """Whether the kernel takes this layer's weight and bias as they are: float32,
    contiguous, its input width a whole number of vectors."""
    b = m.bias
    return (m.in_features % width == 0 and m.weight.is_contiguous()
            and (b is None or (b.dtype == torch.float32 and b.is_contiguous() and b.shape == (m.out_features,))))


def _plan_fits(plan: tuple[int, ...] | None, large: bool, kernel: bool) -> bool:
    """Whether a kept plan (`linear_plans`) is one `_timed_plan` could have made for a
    weight of this kind: a method per row bucket, each TORCH / KERNEL / PACKED, some not
    TORCH; the kernel only where it takes the layer and for at most `MAX_ROWS` rows; a
    large weight oneDNN's at every row count."""
    if plan is None:
        return True
    if (len(plan) != len(PROBE_ROWS) or not all(type(h) is int and h in (TORCH, KERNEL, PACKED) for h in plan)
            or not any(plan)):
        return False
    if large:
        return all(h == PACKED for h in plan)
    return all(h != KERNEL or (kernel and r <= MAX_ROWS) for h, r in zip(plan, PROBE_ROWS))


def _fixed_plan(large: bool, kernel: bool, packable: bool) -> tuple[int, ...] | None:
    """The `inflight` rule, for layers whose input width is a whole number of the kernel's
    vectors: the kernel up to `PACKED_KERNEL_ROWS` rows (one torch thread, a packed copy
    beside) or `MAX_ROWS`, oneDNN above; a large weight oneDNN's."""
    if large:
        return (PACKED,) * len(PROBE_ROWS) if packable else None
    kernel_rows = PACKED_KERNEL_ROWS if packable and torch.get_num_threads() == 1 else MAX_ROWS
    plan = tuple(KERNEL if kernel and r <= kernel_rows else PACKED if packable else TORCH for r in PROBE_ROWS)
    return plan if any(plan) else None


def _timed_plan(m: torch.nn.Linear, large: bool, kernel: bool,
                packable: bool) -> tuple[tuple[int, ...] | None, torch.Tensor | None]:
    """The `auto` rule: time torch's GEMM, the kernel and oneDNN on `m`'s weight at each
    of `PROBE_ROWS` (rounds in turn, the fastest of each kept) and plan the fastest where
    it beats torch's by `MIN_GAIN`; a large weight goes packed only where oneDNN wins over
    the probes together. The plan (None: torch's GEMM throughout) and `m`'s weight as
    packed for the timing (None where it could not be)."""
    w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()
    packed = _reorder(w) if packable else None
    probes = {TORCH: w}
    for how, usable in ((KERNEL, kernel), (PACKED, packed is not None)):
        if usable:
            probes[how] = w.detach()  # another tensor object on the same storage, carrying its plan
            probes[how].inflight_plan = (how,) * len(PROBE_ROWS)
            probes[how].inflight_packed = packed
    if len(probes) == 1:
        return None, packed
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(r, m.in_features, generator=g) for r in PROBE_ROWS]
    cells = [(how, i) for i, r in enumerate(PROBE_ROWS) for how in probes if how != KERNEL or r <= MAX_ROWS]
    op = torch.ops.inflight.float_linear
    best = dict.fromkeys(cells, math.inf)
    rounds, spent = -1, 0.0  # round -1 warms up (oneDNN builds its primitives at a shape's first call)
    with torch.no_grad():
        while rounds < 2 or (rounds < 15 and spent < PROBE_BUDGET_S):
            t_round = time.perf_counter()
            for how, i in cells:
                t = time.perf_counter()
                if how == TORCH:
                    F.linear(xs[i], w, b)
                else:
                    op(xs[i], probes[how], b)
                if rounds >= 0:
                    best[how, i] = min(best[how, i], time.perf_counter() - t)
            spent += (time.perf_counter() - t_round) if rounds >= 0 else 0.0
            rounds += 1
    return _choose(best, large), packed


def _choose(best: dict[tuple[int, int], float], large: bool) -> tuple[int, ...] | None:
    """The plan from timings (`best[method, probe index]`, seconds; `_timed_plan`): per
    probe the fastest method where it beats torch's GEMM by `MIN_GAIN`; for a `large`
    weight, oneDNN at every row count where its time over the probes together
    (geometric mean of its ratios to torch's) beats torch's by `MIN_GAIN`. None: torch's
    GEMM throughout."""
    probes = range(len(PROBE_ROWS))
    if large:
        if any((PACKED, i) not in best for i in probes):
            return None
        ratio = math.exp(sum(math.log(best[PACKED, i] / best[TORCH, i]) for i in probes) / len(PROBE_ROWS))
        return (PACKED,) * len(PROBE_ROWS) if ratio * MIN_GAIN <= 1.0 else None
    plan = []
    for i in probes:
        fastest = min((how for how in (TORCH, KERNEL, PACKED) if (how, i) in best), key=lambda how: best[how, i])
        plan.append(fastest if best[fastest, i] * MIN_GAIN <= best[TORCH, i] else TORCH)
    return tuple(plan) if any(plan) else None


def _reorder(w: torch.Tensor) -> torch.Tensor | None:
    """`w` in oneDNN's packed layout, or None where this torch cannot pack it."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT)
    except (RuntimeError, AttributeError) as e:  # a build without the op, or a layout it refuses
        log.debug("linear layer %s not packed for oneDNN: %s", tuple(w.shape), e)
        return None


def _apply(m: torch.nn.Linear, plan: tuple[int, ...], large: bool, packed: torch.Tensor | None = None) -> bool:
    """Make `m` a `SmallBatchLinear` with `plan`, its weight packed where the plan uses
    oneDNN (`packed` when given: its weight packed already; held packed only when
    `large`). False, `m` left alone, where oneDNN refuses a weight the plan cannot do
    without."""
    packed = (packed if packed is not None else _reorder(m.weight)) if PACKED in plan else None
    if PACKED in plan and packed is None:
        if large:
            return False
        plan = tuple(TORCH if how == PACKED else how for how in plan)
        if not any(plan):
            return False
    m.__class__ = SmallBatchLinear
    if large:
        m.weight = torch.nn.Parameter(m.weight.new_empty(m.weight.shape[0], 0), requires_grad=False)
    m.weight.inflight_plan = plan
    if packed is not None:
        m.weight.inflight_packed = packed
    return True


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the oneDNN-packed weights `install` gave `model`'s layers."""
    return sum(p.numel() * p.element_size() for m in model.modules() if type(m) is SmallBatchLinear
               if (p := getattr(m.weight, "inflight_packed", None)) is not None)
