"""The batched LoRA delta on the CPU: a C kernel (`cpu_lora.c`, SGMV as Punica computes it,
Chen et al. 2023) that adds every token's adapter delta `(x @ A^T) @ (B * scale)^T` in one
call per projection, tokens taken four at a time within their adapter's segment, rows
read and written in place by index. The torch path (`worker.model.lora.add_lora_delta`'s
grouped `bmm`s) costs a gather, two batched matmuls and a scatter per projection, each a
dispatch of several microseconds on a decode step whose arithmetic is a few microseconds.

float32 only (the CPU's serving dtype); built by `cbuild` at first use for the CPU it runs
on (AVX-512, or AVX2 + FMA); without a compiler or either instruction set (logged once),
or for other dtypes, `worker.model.lora` keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from worker.model.kernels import cbuild, native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_lora.c")
MAX_RANK = 64  # the C source's MAX_RANK


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded kernel library, or why it is not used (a string; logged once): no
    compiler, a failed build, or a CPU with neither AVX-512 nor AVX2 + FMA."""
    lib = load()
    if isinstance(lib, str):
        log.warning("CPU LoRA kernel is unavailable (%s); LoRA deltas use torch's batched matmuls", lib)
    return lib


def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | str:
    """The kernel library built with `extra_flags` beside `-fopenmp` (`cbuild.build`; e.g.
    `-mno-avx512f` builds the AVX2 path on an AVX-512 CPU, as the tests do), its
    functions typed; or why it is not used (a string)."""
    lib = cbuild.build(SOURCE, ("-fopenmp", *extra_flags))
    if isinstance(lib, str):
        return lib
    lib.inflight_lora_vectorized.restype = ctypes.c_int
    lib.inflight_lora_vectorized.argtypes = []
    if not lib.inflight_lora_vectorized():
        return "a CPU with neither AVX-512 nor AVX2 + FMA"
    fn = lib.inflight_lora_sgmv
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return not isinstance(_library(), str)


@functools.cache
def _address() -> int:
    """The kernel function's address, for the C++ operator (`native.py`) to call it."""
    return ctypes.cast(_library().inflight_lora_sgmv, ctypes.c_void_p).value


def takes(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether the kernel serves this projection: float32 CPU tensors with unit column
    stride, a rank it holds, and the library built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and a.dtype == torch.float32 and x.stride(-1) == 1
            and a.shape[2] <= MAX_RANK and available())


class Segments:
    """A step's adapter tokens grouped by slot, checked once and held for the kernel's
    calls (one per projection): segment g is `order[seg_start[g]:seg_start[g + 1]]`, tokens
    of slot `seg_slot[g]`.

    Args:
        order: `[M]` int64 token indices below `num_tokens`; seg_start: `[G + 1]` int64
            offsets into it, from 0 to M, never decreasing; seg_slot: `[G]` int64 slots.
            CPU tensors.
        num_tokens: the step's packed tokens (the rows of x and y).
        max_loras: the slots in the weight buffers (every `seg_slot` below it).

    Raises:
        ValueError: an index out of range, or tensors of another dtype or device.
    """

    def __init__(self, order: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor, num_tokens: int,
                 max_loras: int) -> None:
        index = (order, seg_start, seg_slot)
        if any(t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous() for t in index):
            raise ValueError("Segments: order, seg_start and seg_slot must be contiguous int64 CPU tensors")
        # checked as lists: a step's few hundred indices cost less so than by tensor reductions
        rows, starts, slots = order.tolist(), seg_start.tolist(), seg_slot.tolist()
        g, m = len(slots), len(rows)
        if (order.dim() != 1 or seg_slot.dim() != 1 or seg_start.shape != (g + 1,)
                or (g and (starts[0] != 0 or starts[-1] != m)) or any(u > v for u, v in zip(starts, starts[1:]))
                or (m and not (min(rows) >= 0 and max(rows) < num_tokens))
                or (g and not (min(slots) >= 0 and max(slots) < max_loras))):
            raise ValueError(f"Segments: order {rows}, seg_start {starts}, seg_slot {slots} for {num_tokens} "
                             f"tokens and {max_loras} slots")
        self.tensors = index  # kept alive while the pointers are used
        self.num_tokens = num_tokens
        self.max_loras = max_loras
        self.pointers = (order.data_ptr(), seg_start.data_ptr(), seg_slot.data_ptr(), g)


class WeightArgs(NamedTuple):
    """Every projection's weight buffers as the kernel's arguments (`weight_args`)."""

    loras: int  # the slots the buffers hold
    args: list[tuple[int, int, int, int, int]]  # per projection: in, out, a's address, b's address, rank
    table: torch.Tensor  # the same `[projections, 5]` int64, as the C++ operator reads them


def weight_args(weights: list[tuple[torch.Tensor, torch.Tensor]]) -> WeightArgs:
    """Every projection's weight buffers as the kernel's arguments, checked once.

    Args:
        weights: projection index -> (a `[max_loras, in, r]`, b `[max_loras, r, out]`),
            `LoRAWeights.by_index`: float32 contiguous CPU buffers whose storage does not
            move while they are used (the runner fills them in place, between forwards).

    Raises:
        ValueError: buffers the kernel does not take (their shapes and dtypes named).
    """
    loras, args = 0, []
    for a, b in weights:
        loras, d_in, r = a.shape
        if (a.dtype != torch.float32 or b.dtype != torch.float32 or a.device.type != "cpu" or b.device.type != "cpu"
                or not (a.is_contiguous() and b.is_contiguous()) or b.shape[:2] != (loras, r)
                or not 1 <= r <= MAX_RANK or (args and loras != weights[0][0].shape[0])):
            raise ValueError(f"weight_args: a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}")
        args.append((d_in, b.shape[2], a.data_ptr(), b.data_ptr(), r))
    return WeightArgs(loras, args, torch.tensor(args, dtype=torch.int64).view(-1, 5))


class BoundKernel:
    """The kernel bound to one step's grouping and to the weight buffers' arguments
    (`weight_args`, built once for the engine's life), so that a call checks only what can
    differ between calls: its input and output tensors. A compiled LoRA forward makes one
    call per projection per step, and `lora_sgmv`'s checks of everything cost about as much
    as a decode step's arithmetic on a small model (5 of 16 us a call, measured).

    Args:
        segments: the step's grouping.
        weights: `weight_args(...)` of the buffers the step runs with.

    Raises:
        RuntimeError: the library is unavailable (`available()` False).
        ValueError: the buffers hold fewer slots than the grouping names.
    """

    def __init__(self, segments: Segments, weights: WeightArgs) -> None:
        lib = _library()
        if isinstance(lib, str):
            raise RuntimeError(f"inflight_lora_sgmv: the kernel is unavailable ({lib})")
        if weights.loras < segments.max_loras:
            raise ValueError(f"BoundKernel: {weights.loras} slots in the buffers, {segments.max_loras} in the grouping")
        self._fn = lib.inflight_lora_sgmv
        self._weights = weights.args
        self._table = weights.table
        self._segments = segments  # keeps its index tensors alive while the pointers are used
        self._n = segments.num_tokens
        self._tail = segments.pointers
        self._threads = torch.get_num_threads()

    def bind_native(self) -> None:
        """Bind this step to the calling thread's C++ operator
        (`torch.ops.inflight_native.lora_delta`, `native.py`): its calls until the next
        binding compute what `__call__` does, falling back to `inflight::lora_delta`
        where `__call__` returns False.

        Raises:
            RuntimeError: the C++ operators are unavailable (`native.available()` False).
        """
        if not native.available():
            raise RuntimeError("BoundKernel.bind_native: the C++ operators are unavailable")
        order, starts, slots = self._segments.tensors
        torch.ops.inflight_native.lora_bind(self._table, order, starts, slots, self._n, self._threads, _address())

    def __call__(self, x: torch.Tensor, y: torch.Tensor, projection: int) -> bool:
        """`lora_sgmv(x, y, *weights[projection], segments)` when the kernel takes `x`
        `[N, in]` and `y` `[N, out]` (float32 CPU tensors with unit column stride, N the
        step's tokens: what the call's memory safety needs); False, doing nothing, when it
        does not (the caller keeps its torch path, as `takes` tells it elsewhere).

        Raises:
            RuntimeError: the kernel refused the call.
        """
        d_in, d_out, a, b, r = self._weights[projection]
        if (x.shape != (self._n, d_in) or y.shape != (self._n, d_out) or x.dtype != torch.float32
                or y.dtype != torch.float32 or not x.is_cpu or not y.is_cpu or x.stride(1) != 1 or y.stride(1) != 1):
            return False
        order, starts, slots, g = self._tail
        status = self._fn(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a, b, order, starts, slots, g, d_in,
                          d_out, r, self._threads)
        if status != 0:
            raise RuntimeError(f"inflight_lora_sgmv returned {status} (1: rank over {MAX_RANK}, 2: no vector path)")
        return True


def lora_sgmv(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: Segments) -> None:
    """`y[t] += (x[t] @ a[s]) @ b[s]` in place for every token t of every segment (slot s).

    Args:
        x: `[N, in]` float32, unit column stride (any row stride); y: `[N, out]` likewise (mutated).
        a: `[max_loras, in, r]`, b: `[max_loras, r, out]` float32, contiguous (`LoRAWeights`'
            buffers: checked here only for what the call's memory safety needs).
        segments: the step's grouping, N tokens.

    Raises:
        ValueError: shapes or layouts the kernel does not take.
        RuntimeError: the library is unavailable (`available()` False) or refused the call.
    """
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(f"inflight_lora_sgmv: the kernel is unavailable ({lib})")
    n, d_in = x.shape
    loras, _, r = a.shape
    d_out = b.shape[2]
    if (y.shape[0] != n or y.shape[1] != d_out or n != segments.num_tokens or a.shape[1] != d_in
            or loras < segments.max_loras or b.shape[0] != loras or b.shape[1] != r or x.stride(1) != 1
            or y.stride(1) != 1 or not (a.is_contiguous() and b.is_contiguous())):
        raise ValueError(f"lora_sgmv: x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)} for {segments.num_tokens} tokens and {segments.max_loras} slots")
    status = lib.inflight_lora_sgmv(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), a.data_ptr(), b.data_ptr(),
                                    *segments.pointers, d_in, d_out, r, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"inflight_lora_sgmv returned {status} (rank {r}; 1: over {MAX_RANK}, 2: no vector path)")
