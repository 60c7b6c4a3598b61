"""Float32 linear layers on the CPU: a small-batch kernel for a few rows, oneDNN's
pre-packed weights for the rest.

A step of a few requests multiplies each weight by a few rows, and torch's GEMM runs such
a product on one thread (measured on the 2-core benchmark box: the benchmark model's 29
weights took 0.63 ms at 1 row, 1.2-1.7 ms at 2-4 rows; 1 or 2 torch threads alike). The C
kernel of the weight-only layers (`kernels/cpu_woq.c`, `inflight_float_linear`: its
register tiles with float weights) splits the output channels over torch's threads
instead: 0.50 ms and 0.57-0.69 ms. A whole decode step (`tools.bench.small_batch`):
1.25-1.32x faster at 2-4 running, 1.05-1.09x at 8, the same at 1 (docs/benchmarks.md).

Above a few rows, torch's float32 GEMM is MKL's `sgemm`, which on the AMD benchmark box
gains little from a second thread. A weight packed once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, multiplied by `mkldnn._linear_pointwise`:
the kernels Inductor's freezing uses, as vLLM's CPU build packs its weights for oneDNN)
multiplies 16-256 rows 1.1-1.25x faster than MKL on one thread and 1.5-3.4x on two (the
benchmark models' weights, op alone). Its per-call cost (~8 us) loses to the kernel on a
few rows of a small weight, and the kernel's split over threads keeps it ahead up to 8
rows with two threads. So a packed layer takes the kernel up to `PACKED_KERNEL_ROWS` rows
when torch has one thread, `MAX_ROWS` with more, while it keeps its plain weight, and
oneDNN above. A weight larger than `PLAIN_COPY_BYTES` is held packed only: its `weight`
becomes an `[out_features, 0]` placeholder, so memory stays as before; the price is its
product of one row, where the kernel streams the plain layout from memory faster (the
~160M benchmark model's one-request step took 1.15x as long on two threads, 1.27x on
one, its 32-request step 0.53x: docs/benchmarks.md). A module marked
`inflight_reads_weight` (a wrapper that reads the weight itself: `latent.py`,
`legacy.py`) keeps its plain weight: beside a packed copy up to `PLAIN_COPY_BYTES`,
and above that as the `nn.Linear` it is, on torch's GEMM. A large plain weight under
this op is what crashed a captured forward (docs/limits.md, Performance).

`install` turns a loaded model's `nn.Linear` layers into `SmallBatchLinear` (the same
module, parameters and hooks, another class) whose forward is the op
`torch.ops.inflight.float_linear`: the kernel at a few rows, the packed weight above, and
`F.linear` (torch's GEMM) where there is no packed weight, for anything the kernel does
not take. The packed weight rides on the weight tensor
(`weight.inflight_packed`), so a compiled forward, whose graphs take the parameters as
inputs, multiplies each model's own weights even where two models share a graph. A
compiled forward keeps the op as one opaque node, as it keeps torch's GEMM (an extern
call) where the layer was an `nn.Linear`. The op is declared with `torch.library.Library`
(a call costs about 2 us against 4 us for `custom_op`, `worker.model.lora`). Sums run in
another order than torch's GEMM: results differ in the last bits, as a compiled forward's
do from an eager one.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from worker.model.kernels import cpu_woq

log = logging.getLogger(__name__)

MAX_ROWS = 8  # rows (tokens) at which the kernel was measured faster than torch's GEMM
PACKED_KERNEL_ROWS = 2  # ...and than oneDNN's packed product when torch has one thread
PACK_ROWS_HINT = 32  # the row count oneDNN lays a packed weight out for (any count is multiplied)
PLAIN_COPY_BYTES = 2 << 20  # a weight up to this size keeps its plain layout beside the packed one

_LIB = torch.library.Library("inflight", "FRAGMENT")
_LIB.define("float_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`torch.ops.inflight.float_linear`: `F.linear(x, weight, bias)`, by the CPU kernel
    or the weight's oneDNN-packed copy where they serve (module docstring).

    Args:
        x: `[..., in_features]`; weight: `[out_features, in_features]`, or a packed-only
            layer's `[out_features, 0]` placeholder, either with its packed copy as
            `weight.inflight_packed` where `install` made one; bias: `[out_features]` or None.

    Returns:
        `[..., out_features]` in `x`'s dtype.

    Raises:
        RuntimeError: the kernel failed (it returns 0 for every operand it is given
            here), or `weight` is a packed layer's placeholder and `x` is no float32 CPU
            tensor.
    """
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    packed = getattr(weight, "inflight_packed", None)
    width = _width()  # 0: no vector tiles (or no kernel): torch's GEMM
    if (width and 0 < rows <= _kernel_rows(packed) and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.is_cpu and weight.is_cpu and weight.is_contiguous() and weight.shape[1] == k
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.is_cpu
                                  and bias.shape == (weight.shape[0],)))
            and k % width == 0):
        x2 = x.reshape(rows, k).contiguous()
        y = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        status = cpu_woq.float_linear(x2, weight, bias, y)
        if status != 0:
            raise RuntimeError(f"inflight_float_linear returned {status}")
        return y.view(*x.shape[:-1], weight.shape[0])
    if packed is not None and x.dtype == torch.float32 and x.is_cpu:
        if rows == 0:
            return x.new_empty(*x.shape[:-1], weight.shape[0])
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, k).contiguous(), packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], weight.shape[0])
    if weight.shape[-1] != k and packed is not None:
        raise RuntimeError(f"a linear layer held only in oneDNN's packed layout takes float32 CPU rows, got "
                           f"{x.dtype} on {x.device}")
    return F.linear(x, weight, bias)


def _kernel_rows(packed: torch.Tensor | None) -> int:
    """Rows up to which the kernel serves a layer (module docstring)."""
    return MAX_ROWS if packed is None or torch.get_num_threads() > 1 else PACKED_KERNEL_ROWS


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


def install(model: torch.nn.Module, plain_copy_bytes: int | None = None) -> int:
    """Make every float32 CPU `nn.Linear` of `model` (exactly that class: quantized layers
    and others are left) whose input width is a whole number of the kernel's vectors a
    `SmallBatchLinear` with its weight packed for oneDNN where torch has oneDNN (module
    docstring; weights over `plain_copy_bytes`, default `PLAIN_COPY_BYTES`, held packed
    only, or left as they are where the module reads its weight), in place; how many (0
    when the kernel has no vector tiles on this CPU, or could not be built)."""
    layers = [m for m in model.modules()
              if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    width = _width() if layers else 0  # no CPU float layer (a GPU model): the kernel is not even built
    n = 0
    limit = PLAIN_COPY_BYTES if plain_copy_bytes is None else plain_copy_bytes
    for m in layers:
        large = m.weight.numel() * m.weight.element_size() > limit
        if large and getattr(m, "inflight_reads_weight", False):
            continue  # a large weight that must stay plain stays an `nn.Linear` (module docstring)
        if width and m.in_features % width == 0:
            m.__class__ = SmallBatchLinear
            _pack(m, keep_plain=not large)
            n += 1
    if n:
        log.debug("%d float32 linear layers made SmallBatchLinear (the CPU small-batch kernel, oneDNN above it)", n)
    return n


def _pack(m: SmallBatchLinear, keep_plain: bool) -> None:
    """Give `m`'s weight its oneDNN-packed copy (`weight.inflight_packed`), and unless
    `keep_plain`, drop the plain one for an `[out_features, 0]` placeholder (module
    docstring). Leaves `m` as it was where torch cannot pack (no oneDNN)."""
    w = m.weight
    if not torch.backends.mkldnn.is_available():
        return
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT)
    except (RuntimeError, AttributeError) as e:  # a build without the op, or a layout it refuses
        log.debug("linear layer %s not packed for oneDNN: %s", tuple(w.shape), e)
        return
    if not keep_plain:
        m.weight = torch.nn.Parameter(w.new_empty(w.shape[0], 0), requires_grad=False)
    m.weight.inflight_packed = packed


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the oneDNN-packed weights `install` gave `model`'s layers."""
    return sum(p.numel() * p.element_size() for m in model.modules() if type(m) is SmallBatchLinear
               if (p := getattr(m.weight, "inflight_packed", None)) is not None)
