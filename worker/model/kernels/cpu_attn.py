"""The CPU back end: the torch reference, with decodes run by a C kernel that reads each
sequence's KV blocks in place (`cpu_decode.c`) instead of gathering a padded copy of its
context and masking it. Same contract as `torch_ref.py`.

Why: on the CPU decode attention is memory-bound, and the reference moves each context
three times (gather K and V into a padded copy, then read the copy). Measured on the
2-core box: one layer of 32 sequences of 100-320 tokens (8 query / 4 KV heads of 32, one
thread) 0.7 ms vs 2.0-2.2 ms, largest difference 5e-7; the engine on the benchmark model
with one intra-op thread (the worker's engine process here) 1.33x faster on ShareGPT-like
requests (long contexts), 1.02x on the short mixed workload. The kernel spreads its rows
(with fewer rows than threads, parts of a row's KV heads) over torch's intra-op threads
(OpenMP, the runtime torch uses; one thread runs without a parallel region, whose
overhead cost ~5%), each head's sums in one order whatever the thread count: on two
threads (an Intel Xeon box) 1.35-1.86x its one-thread time, where on one thread it lost
to the reference's two-threaded gather at 8 rows of 1024 tokens (0.77x). Layers with
soft-capping, sinks or ALiBi, caches neither fp32 nor int8 (`kv_int8.py`, read with their
scales) and steps with prefill chunks longer than `MAX_CHUNK_ROWS` take the reference path;
a step whose chunks are all that short (a speculating decode's verification, a draft
model's catch-up, a short prompt) runs every token as a row of the kernel, reading its
context up to itself (`token_rows`): its chunk's K/V are written before attention runs.

The kernel is compiled at first use by `cbuild` (the machine's C compiler, `-O3
-march=native -fopenmp`, without `-fopenmp` where the compiler has no OpenMP, cached by a hash of the source, compiler and CPU) and loaded with ctypes
(the call releases the GIL). `available()` says whether it could be built;
`get_backend("auto", "cpu")` uses this back end then and the reference otherwise (the
reason is logged once).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.model.kernels import cbuild, torch_ref
from worker.model.kernels.params import AttentionParams

if TYPE_CHECKING:
    from worker.model.attention import AttentionMetadata

log = logging.getLogger(__name__)

READS_INT8_KV = True  # int8 caches with their scales (kv_int8.py): decodes in the kernel too
USES_DENSE_METADATA = True  # layers that fall back to the reference read its decode groups
SOURCE = Path(__file__).with_name("cpu_decode.c")

write_kv = torch_ref.write_kv


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded kernel library, or why it could not be built (a string). A compiler
    without OpenMP builds it without (its pragmas ignored: one thread whatever torch has)."""
    lib = cbuild.build(SOURCE, ("-fopenmp",))
    if isinstance(lib, str):
        lib = cbuild.build(SOURCE)
        if isinstance(lib, str):
            return lib
        log.warning("the CPU decode kernel was built without OpenMP: it runs on one thread")
    fn = lib.inflight_paged_decode
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr] * 6 + [i64] * 13 + [ctypes.c_float, i64, i64]
    fn.restype = ctypes.c_int
    fn8 = lib.inflight_paged_decode_int8
    fn8.argtypes = [ptr] * 8 + [i64] * 13 + [ctypes.c_float, i64, i64]
    fn8.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return not isinstance(_library(), str)


def kernel_address() -> int | None:
    """The fp32 kernel function's address, for the C++ operator (`native.py`) to call
    it; None if the kernel is unavailable."""
    lib = _library()
    return None if isinstance(lib, str) else ctypes.cast(lib.inflight_paged_decode, ctypes.c_void_p).value


def unavailable_reason() -> str | None:
    lib = _library()
    return lib if isinstance(lib, str) else None


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None, out: torch.Tensor,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """Decode attention of `query` `[rows, num_heads, head_dim]` (one token per sequence,
    fp32) into `out` `[rows, num_heads, v_head_dim]` (contiguous, fp32), sequence r
    reading its first `seq_lens[r]` positions (the last `window` of them if set) through
    `block_tables[r]` (int32, contiguous rows). `scales`: int8 caches' key and value scales
    (`kv_int8`, contiguous). False (out incomplete) if the kernel is unavailable or failed;
    the caller then uses the reference."""
    lib = _library()
    if isinstance(lib, str):
        return False
    q = query.contiguous()
    rows, num_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_cache.shape[2], v_cache.shape[-1]
    ptrs = [q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()]
    if scales is not None:
        ptrs += [scales[0].data_ptr(), scales[1].data_ptr()]
    fn = lib.inflight_paged_decode if scales is None else lib.inflight_paged_decode_int8
    status = fn(*ptrs, block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), rows, block_tables.stride(0),
                num_heads, num_kv_heads, head_dim, v_dim, k_cache.shape[1], *k_cache.stride()[:3],
                *v_cache.stride()[:3], scale, window or 0, torch.get_num_threads())
    return status == 0


MAX_CHUNK_ROWS = 16  # steps whose chunks are at most this long run every token as a row of the kernel


def token_rows(query_start: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of a packed step as a decode row: its sequence's block table `[tokens,
    max_blocks]` int32 and its own context length (its position + 1) `[tokens]` int32.

    Args:
        query_start: `[num_seqs + 1]` each sequence's first token in the step (int32).
        block_tables: `[num_seqs, max_blocks]` int32; seq_lens: `[num_seqs]` context
            after the step, int32.
    """
    starts = query_start.long()
    owner = torch.repeat_interleave(torch.arange(seq_lens.shape[0]), starts[1:] - starts[:-1])
    behind = starts[1:].index_select(0, owner) - 1 - torch.arange(owner.shape[0])  # tokens after it in its chunk
    lens = seq_lens.long().index_select(0, owner) - behind
    return block_tables.index_select(0, owner), lens.to(torch.int32)


def _kernel_fits(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                 p: AttentionParams, int8: bool = False) -> bool:
    cache = torch.int8 if int8 else torch.float32
    return ((md.num_decodes > 0 or md.max_query_len <= MAX_CHUNK_ROWS) and not p.changes_logits
            and query.dtype == torch.float32 and k_cache.dtype == v_cache.dtype == cache
            and not query.is_cuda and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and md.block_tables.dtype == md.seq_lens.dtype == torch.int32 and md.block_tables.stride(-1) == 1
            and query.shape[1] % k_cache.shape[2] == 0)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    params: AttentionParams | float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`torch_ref.paged_attention`'s contract; decodes through the kernel when it fits
    (module docstring); int8 caches (`scales`) through the reference."""
    p = params if isinstance(params, AttentionParams) else AttentionParams(scale=float(params))
    if not _kernel_fits(query, k_cache, v_cache, md, p, int8=scales is not None):
        return torch_ref.paged_attention(query, key, value, k_cache, v_cache, md, p, scales=scales)
    nd = md.num_decodes
    out = query.new_empty(query.shape[0], query.shape[1], v_cache.shape[-1])
    if nd < query.shape[0] and md.max_query_len <= MAX_CHUNK_ROWS:  # short chunks: a row per token
        tables, seq_lens = token_rows(md.query_start_loc, md.block_tables, md.seq_lens)
        if paged_decode(query, k_cache, v_cache, tables, seq_lens, p.scale, p.sliding_window, out, scales):
            return out
        return torch_ref.paged_attention(query, key, value, k_cache, v_cache, md, p, scales=scales)
    if not paged_decode(query[:nd], k_cache, v_cache, md.block_tables, md.seq_lens, p.scale, p.sliding_window,
                        out[:nd], scales):
        return torch_ref.paged_attention(query, key, value, k_cache, v_cache, md, p, scales=scales)
    if nd < query.shape[0]:  # the prefill chunks through the reference
        prefills = md.dense()[1]
        torch_ref.paged_attention(query, key, value, k_cache, v_cache,
                                  replace(md, decode_groups=[], prefills=prefills, build_dense=None), p, out=out,
                                  scales=scales)
    return out
