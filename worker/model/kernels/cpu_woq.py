"""Weight-only quantized matmul on the CPU (W8A16, W4A16): a C kernel (`cpu_woq.c`) that
reads `QuantLinear`'s integers as stored and widens them in registers, so a decode step
reads 1 (int8) or 0.5 (int4) bytes per weight instead of 4, and no float weight is ever
written. Exposed to `torch.compile` as the op `inflight::woq_linear`, which a
compiled forward keeps as one opaque call.

Why: dequantizing the weight per call (the torch path) writes and re-reads a float copy of
it, slower than the float model itself (0.8-0.9x its decode step compiled, 0.27x eager).
Measured on the 2-core AVX-512 box, 8 distinct projections of each of the benchmark model's
shapes (1024x1024, 3072x1024, 1024x3072), two threads, against fp32 `F.linear`: int8 per
channel 2.8x (1 row), 3.3x (4), 1.8x (16), 1.3x (32); int4 in groups of 128 2.8x, 3.0x,
1.4x, 1.06x; the whole decode step of the ~160M-parameter model 1.96x (int8) and 2.47x
(int4) the fp32 one at 1 request (docs/benchmarks.md). Decode batches of up to 4 rows (and
per-channel int8 up to 32) widen the integers straight into registers, prefetching each
weight row 8 KiB ahead into L2; other batches of up to `MAX_ROWS` dequantize 4 output
channels at a time into a per-thread buffer the rows then share; larger ones (prefill
chunks) dequantize the weight in the kernel and multiply with torch's GEMM.

Threads: OpenMP over blocks of output channels, in the process's OpenMP runtime (the
libgomp torch loaded), as many as `torch.get_num_threads()` at each call. The library is
built by `cbuild` for the CPU it runs on (`-march=native`): AVX-512 tiles of 16 lanes, or
AVX2 + FMA tiles of 8 (x86 without AVX-512: AMD before Zen 4, most client Intel; int4 at one
row folds each group's scale and zero point into one correction, 1.3x faster on the AVX-512
box built for AVX2, docs/benchmarks.md). Without
a compiler (logged once), on a CPU with neither, or for groups that are not whole vectors
(`fast`), `QuantLinear` dequantizes with torch instead and never calls the op.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.model.kernels import cbuild

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_woq.c")
# Batches of more rows (prefill chunks) dequantize the weight in the kernel and multiply it
# with torch's GEMM: the kernel's own tiles do not block rows for the caches, and at 256 rows
# of a 3072 x 1024 layer were 1.1-1.6x slower than fp32, at 1024 rows 3x; at 64 they were
# even with it (int8) or faster (int4).
MAX_ROWS = 64


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded kernel library, or why it could not be built (a string; logged once)."""
    lib = load()
    if isinstance(lib, str):
        log.warning("CPU weight-only matmul kernel is unavailable (%s); quantized layers dequantize per call", lib)
    return lib


def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | str:
    """The kernel library built with `extra_flags` beside `-fopenmp` (`cbuild.build`; e.g.
    `-mno-avx512f` builds the AVX2 tiles on an AVX-512 CPU, as the tests do), its functions
    typed; or why it could not be built (a string)."""
    lib = cbuild.build(SOURCE, ("-fopenmp", *extra_flags))
    if isinstance(lib, str):
        return lib
    fn = lib.inflight_woq_linear
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr] * 6 + [i64] * 6
    fn.restype = ctypes.c_int
    deq = lib.inflight_woq_dequantize
    deq.argtypes = [ptr] * 4 + [i64] * 5
    deq.restype = ctypes.c_int
    lib.inflight_woq_vectorized.restype = ctypes.c_int
    lib.inflight_woq_vectorized.argtypes = []
    flin = lib.inflight_float_linear
    flin.argtypes = [ptr] * 4 + [i64] * 4
    flin.restype = ctypes.c_int
    return lib


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> int:
    """`y = x @ weight.T (+ bias)` by the kernel's float tiles (`inflight_float_linear`):
    x `[..., K]` (M rows in all), weight `[N, K]`, bias `[N]` or None, y `[..., N]` (M rows),
    all float32, contiguous, on the CPU (the caller checks:
    `worker.model.small_batch.float_linear`). Returns the kernel's status (0), or -1 when
    the library is unavailable."""
    lib = _library()
    if isinstance(lib, str):
        return -1
    k = x.shape[-1]
    return lib.inflight_float_linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                     y.data_ptr(), x.numel() // k, k, weight.shape[0], torch.get_num_threads())


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return not isinstance(_library(), str)


def vector_width() -> int:
    """Float lanes of the kernel's vector tiles as built for this CPU: 16 (AVX-512), 8 (AVX2
    with FMA), 0 (neither: only its plain loop, which layers do not use, `fast`; or no
    kernel at all)."""
    return int(_library().inflight_woq_vectorized()) if available() else 0


def vectorized() -> bool:
    """Whether the kernel was built with vector tiles (`vector_width`)."""
    return vector_width() > 0


def fast(in_features: int, groups: int, packed: bool) -> bool:
    """Whether layers of this shape should use the kernel: it takes them (`fits`), it was
    built with vector tiles, and each run of columns sharing a scale is a whole number of
    vectors (16 columns with AVX-512, 8 with AVX2). Elsewhere its plain C loop is correct
    but measured 10-50x slower than fp32 (0.02-0.14x on the benchmark box's shapes), so
    layers then dequantize in torch instead (0.8-0.9x)."""
    if not fits(in_features, groups, packed) or not available():
        return False
    run = in_features // groups if groups > 1 else (in_features // 2 if packed else in_features)
    width = vector_width()
    return width > 0 and run % width == 0


def fits(in_features: int, groups: int, packed: bool) -> bool:
    """Whether the kernel takes a layer: groups dividing the input channels, and for packed
    int4 (`pack_int4`) an even width with groups that do not straddle its two halves."""
    if groups < 1 or in_features % groups:
        return False
    if not packed:
        return True
    return in_features % 2 == 0 and (groups == 1 or (groups % 2 == 0 and (in_features // 2) % (in_features // groups) == 0))


# Declared with `torch.library.Library` rather than `custom_op` (whose wrapper checks the
# output's aliasing at every call: 7.2 against 4.7 us a call, `worker.model.attention`).
_LIB = torch.library.Library("inflight", "FRAGMENT")
_LIB.define("woq_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? zero, Tensor? bias, int in_features) "
            "-> Tensor")


def woq_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               bias: torch.Tensor | None, in_features: int) -> torch.Tensor:
    """`x @ W.T + bias` for the integer weight `W = (q - zero) * scale`, on the CPU: the op
    `torch.ops.inflight.woq_linear`, one opaque node of a compiled forward.

    Args:
        x: `[rows, in_features]` (any float dtype; computed in float32).
        qweight: int8 `[out, in_features]`, or uint8 `[out, in_features / 2]` (`pack_int4`).
        scale: `[out, groups]` float32 (groups of `in_features / groups` input channels).
        zero: `[out, groups]` int8 zero points, or None (symmetric).
        bias: `[out]` or None.
        in_features: the layer's input width (what a packed weight's shape halves).

    Returns:
        `[rows, out]` in `x`'s dtype.

    Raises:
        ValueError: the operands' shapes disagree, or the kernel does not take them (`fits`).
        RuntimeError: the kernel could not be built (`available()` is False), or failed.
    """
    return torch.ops.inflight.woq_linear(x, qweight, scale, zero, bias, in_features)


def _woq_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                bias: torch.Tensor | None, in_features: int) -> torch.Tensor:
    out_features, groups = scale.shape
    packed = qweight.dtype == torch.uint8
    if x.shape[-1] != in_features or qweight.shape[0] != out_features or (
            qweight.shape[1] != (in_features // 2 if packed else in_features)):
        raise ValueError(f"woq_linear: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scale "
                         f"{tuple(scale.shape)} for {in_features} input channels")
    if not fits(in_features, groups, packed):
        raise ValueError(f"woq_linear: {groups} groups over {in_features} input channels "
                         f"({'packed int4' if packed else 'int8'}) are not taken by the kernel")
    lib = _library()
    if isinstance(lib, str):  # QuantLinear does not call the op then (`cpu_kernel`): it dequantizes in torch
        raise RuntimeError(f"inflight::woq_linear: the kernel is unavailable ({lib})")
    xf = x.float().contiguous()
    # every operand bound to a name: a temporary's memory would be freed before the call
    q, s = qweight.contiguous(), scale.contiguous()
    z = None if zero is None else zero.contiguous()
    b = None if bias is None else bias.float().contiguous()
    zp = None if z is None else z.data_ptr()
    threads = torch.get_num_threads()  # OpenMP's own count is per calling thread: the engine's may not be torch's
    if xf.shape[0] > MAX_ROWS:
        w = torch.empty(out_features, in_features, dtype=torch.float32)
        status = lib.inflight_woq_dequantize(q.data_ptr(), s.data_ptr(), zp, w.data_ptr(), in_features, out_features,
                                             groups, 4 if packed else 8, threads)
        if status == 0:
            return F.linear(xf, w, b).to(x.dtype)
    else:
        y = torch.empty(xf.shape[0], out_features, dtype=torch.float32)
        status = lib.inflight_woq_linear(xf.data_ptr(), q.data_ptr(), s.data_ptr(), zp,
                                         None if b is None else b.data_ptr(), y.data_ptr(), xf.shape[0], in_features,
                                         out_features, groups, 4 if packed else 8, threads)
    if status != 0:
        raise RuntimeError(f"inflight_woq_linear returned {status} (1: operands refused, 2: out of memory)")
    return y.to(x.dtype)


_LIB.impl("woq_linear", _woq_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("inflight::woq_linear", lib=_LIB)
def _(x, qweight, scale, zero, bias, in_features):
    return x.new_empty(x.shape[0], scale.shape[0])
