"""Float32 linear layers on the CPU at decode batch sizes: a step of a few requests
multiplies each weight by a few rows, and torch's GEMM runs such a product on one thread
(measured on the 2-core benchmark box: the benchmark model's 29 weights took 0.63 ms at
1 row, 1.2-1.7 ms at 2-4 rows; 1 or 2 torch threads alike). The C kernel of the
weight-only layers (`kernels/cpu_woq.c`, `inflight_float_linear`: its register tiles with
float weights) splits the output channels over torch's threads instead: 0.50 ms and
0.57-0.69 ms. A whole decode step (`tools.bench.small_batch`): 1.25-1.32x faster at 2-4
running, 1.05-1.09x at 8, the same at 1 (docs/benchmarks.md).

`install` turns a loaded model's `nn.Linear` layers into `SmallBatchLinear` (the same
module, parameters and hooks, another class) whose forward is the op
`torch.ops.inflight.float_linear`: the kernel at up to `MAX_ROWS` rows, `F.linear` (torch's
GEMM) above that, and for anything the kernel does not take. A compiled forward keeps the
op as one opaque node, as it keeps torch's GEMM (an extern call) where the layer was an
`nn.Linear`. The op is declared with `torch.library.Library` (a call costs about 2 us
against 4 us for `custom_op`, `worker.model.lora`). Sums run in another order than
torch's GEMM: results differ in the last bits, as a compiled forward's do from an eager one.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from worker.model.kernels import cpu_woq

log = logging.getLogger(__name__)

MAX_ROWS = 8  # rows (tokens) at which the kernel was measured faster than torch's GEMM

_LIB = torch.library.Library("inflight", "FRAGMENT")
_LIB.define("float_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`torch.ops.inflight.float_linear`: `F.linear(x, weight, bias)`, by the CPU kernel
    where it serves (module docstring).

    Args:
        x: `[..., in_features]`; weight: `[out_features, in_features]`; bias: `[out_features]`
            or None.

    Returns:
        `[..., out_features]` in `x`'s dtype.

    Raises:
        RuntimeError: the kernel failed (it returns 0 for every operand it is given here).
    """
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    width = _width()  # 0: no vector tiles (or no kernel): torch's GEMM
    if (width and 0 < rows <= MAX_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.is_cpu
            and weight.is_cpu and weight.is_contiguous() and weight.shape[1] == k
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.is_cpu
                                  and bias.shape == (weight.shape[0],)))
            and k % width == 0):
        x2 = x.reshape(rows, k).contiguous()
        y = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        status = cpu_woq.float_linear(x2, weight, bias, y)
        if status != 0:
            raise RuntimeError(f"inflight_float_linear returned {status}")
        return y.view(*x.shape[:-1], weight.shape[0])
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


def install(model: torch.nn.Module) -> int:
    """Make every float32 CPU `nn.Linear` of `model` (exactly that class: quantized layers
    and others are left) whose input width is a whole number of the kernel's vectors a
    `SmallBatchLinear`, in place; how many (0 when the kernel has no vector tiles on this
    CPU, or could not be built)."""
    layers = [m for m in model.modules()
              if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    width = _width() if layers else 0  # no CPU float layer (a GPU model): the kernel is not even built
    n = 0
    for m in layers:
        if width and m.in_features % width == 0:
            m.__class__ = SmallBatchLinear
            n += 1
    if n:
        log.debug("%d float32 linear layers multiply up to %d rows by the CPU small-batch kernel", n, MAX_ROWS)
    return n
