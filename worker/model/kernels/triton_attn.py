"""Triton back end: paged KV write and paged attention over the packed ragged batch.

Same contract as `torch_ref.py` (shapes, cache layout, results), used automatically on
CUDA. On the CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`, set
before this module is imported), which is how the tests check it against the reference.

Attention (one kernel, two launches per layer: decodes, then prefill chunks) follows the
FlashAttention-2 online softmax (Dao, 2023) over a paged cache (vLLM, SOSP '23): a
program handles `BLOCK_Q` query tokens of one sequence for one KV head *and all the query
heads that share it* (grouped-query attention), so each K/V tile is loaded once per group.
Rows of the tile are (token, head-in-group) pairs: row r is token `r // GROUP_P2`, head
`kv_head * GROUP + r % GROUP_P2`. Keys are visited in tiles of `BLOCK_N` positions, each
gathered through the block table (a tile may span several KV blocks). Causality: the
query at absolute position p (= context length - query length + its index) sees keys at
positions <= p, so a prefill chunk attends to its cached prefix plus itself, and a decode
to the whole context. For long decode contexts at small batch the decode launch splits
each context over `NUM_SPLITS` programs that write unnormalized partials (acc, max, sum),
and `_reduce_splits_kernel` combines them (flash-decoding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from worker.model.kernels.interpreter import drop_interpreter_overflow_checks
from worker.model.kernels.params import AttentionParams

drop_interpreter_overflow_checks()  # on the CPU interpreter: checks it would discard

if TYPE_CHECKING:
    from worker.model.attention import AttentionMetadata

USES_DENSE_METADATA = False  # the runner may skip the reference back end's padded groups and masks
# launches depend on tensor values only (context lengths read on the device, padding slots
# skipped): a decode step's kernels can be captured in a CUDA graph (worker.model.graphs)
GRAPH_SAFE = True
READS_INT8_KV = True  # int8 caches with their scales (kv_int8.py), dequantized tile by tile


@triton.jit
def _write_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, H_P2: tl.constexpr,
    D_P2: tl.constexpr, DV_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_V: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot < 0:  # padding token: nothing to write
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_P2)[:, None]
    d = tl.arange(0, D_P2)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache + blk * stride_cb + off * stride_cs + h * stride_ch + d, k.to(k_cache.dtype.element_ty), mask=mask)
    if HAS_V:
        dv = tl.arange(0, DV_P2)[None, :]
        vmask = (h < NUM_KV_HEADS) & (dv < V_DIM)
        v = tl.load(value + t * stride_vt + h * stride_vh + dv, mask=vmask)
        tl.store(v_cache + blk * stride_vcb + off * stride_vcs + h * stride_vch + dv, v.to(v_cache.dtype.element_ty),
                 mask=vmask)


def write_kv(
    key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V into the paged cache (one program per token).

    Args:
        key: `[num_tokens, num_kv_heads, head_dim]`; value: `[num_tokens, num_kv_heads, v_head_dim]`
            or None (latent attention: the value is part of the cached key); last dimensions contiguous.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim / v_head_dim]`, last
            dimension contiguous, written in place.
        slot_mapping: `[num_tokens]` int64 slot of each token; negative slots are skipped.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    has_v = value is not None
    vv, vc = (value, v_cache) if has_v else (key, k_cache)
    assert key.stride(2) == 1 and vv.stride(2) == 1 and k_cache.stride(3) == 1 and vc.stride(3) == 1
    _write_kv_kernel[(num_tokens,)](
        key, vv, k_cache, vc, slot_mapping,
        key.stride(0), key.stride(1), vv.stride(0), vv.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, V_DIM=vv.shape[2],
        H_P2=triton.next_power_of_2(num_kv_heads), D_P2=max(16, triton.next_power_of_2(head_dim)),
        DV_P2=max(16, triton.next_power_of_2(vv.shape[2])), BLOCK_SIZE=k_cache.shape[1], HAS_V=has_v,
    )


@triton.jit
def _write_kv_int8_kernel(
    x, cache, scale, slot_mapping, stride_xt, stride_xh, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, DIM: tl.constexpr, H_P2: tl.constexpr, D_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot < 0:  # padding token: nothing to write
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_P2)
    d = tl.arange(0, D_P2)[None, :]
    mask = (h[:, None] < NUM_KV_HEADS) & (d < DIM)
    v = tl.load(x + t * stride_xt + h[:, None] * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(v), 1) / 127.0, 1.1754943508222875e-38)  # kv_int8.quantize's rule
    q = tl.minimum(tl.maximum(tl.floor(v / s[:, None] + 0.5), -127.0), 127.0)
    tl.store(cache + blk * stride_cb + off * stride_cs + h[:, None] * stride_ch + d, q.to(tl.int8), mask=mask)
    tl.store(scale + (blk * BLOCK_SIZE + off) * NUM_KV_HEADS + h, s, mask=h < NUM_KV_HEADS)


def write_kv_int8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  scales: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor) -> None:
    """`kv_int8.write_kv`'s contract in one program per token and cache, without a host
    sync (negative slots skipped on the device, as decode graphs need): each row of
    `[num_tokens, num_kv_heads, dim]` rounded by `kv_int8.quantize`'s rule, its scale
    beside it."""
    num_tokens, num_kv_heads = key.shape[:2]
    if num_tokens == 0:
        return
    for x, cache, scale in ((key, k_cache, scales[0]), (value, v_cache, scales[1])):
        assert x.stride(2) == 1 and cache.stride(3) == 1 and scale.is_contiguous()
        _write_kv_int8_kernel[(num_tokens,)](
            x, cache, scale, slot_mapping, x.stride(0), x.stride(1), cache.stride(0), cache.stride(1),
            cache.stride(2), NUM_KV_HEADS=num_kv_heads, DIM=x.shape[2], H_P2=triton.next_power_of_2(num_kv_heads),
            D_P2=max(16, triton.next_power_of_2(x.shape[2])), BLOCK_SIZE=cache.shape[1],
        )


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact limits at both ends (e^2x overflows to inf, or underflows to 0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attn_kernel(
    query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
    part_acc, part_m, part_l, sinks, alibi_slopes, k_scale, v_scale,
    seq_offset, scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
    V_DIM: tl.constexpr, DV_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    KV_INT8: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
):
    seq = tl.program_id(0) + seq_offset
    if NUM_SPLITS == 1:
        q_tile = tl.program_id(1)
        split = 0
    else:  # split-K over the context (flash-decoding): one query tile, grid dim 1 = split
        q_tile = 0
        split = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens + seq)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    r = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + r // GROUP_P2
    g = r % GROUP_P2
    head = kv_head * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    d = tl.arange(0, D_P2)
    d_ok = d < HEAD_DIM
    dv = tl.arange(0, DV_P2)
    dv_ok = dv < V_DIM
    q_ptr = query + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx_len - q_len + tok  # absolute position of each row's token

    if HAS_SINKS and NUM_SPLITS == 1:  # the sink is a key of logit sinks[head] and value 0
        m_i = tl.load(sinks + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        l_i = tl.where(row_ok, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(alibi_slopes + head, mask=row_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P2], tl.float32)
    last_tok = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    kv_end = ctx_len - q_len + last_tok + 1  # keys this tile can see
    kv_lo = 0
    if HAS_WINDOW:  # keys before the first row's window are never read
        kv_lo = tl.maximum(ctx_len - q_len + q_tile * BLOCK_Q - window + 1, 0)
    if NUM_SPLITS > 1:  # this program's share of the keys, whole BLOCK_N tiles
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * chunk
        kv_end = tl.minimum(kv_end, kv_lo + chunk)
    n = tl.arange(0, BLOCK_N)
    for start in range(kv_lo, kv_end, BLOCK_N):
        kv_pos = start + n
        kv_ok = kv_pos < kv_end
        blk = tl.load(block_tables + seq * stride_bt + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0)
        blk = blk.to(tl.int64)
        kv_off = blk * stride_cb + (kv_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache + kv_off[:, None] + d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        if KV_INT8:  # int8 values, a float32 scale per token and KV head (kv_int8.py)
            slot = (blk * BLOCK_SIZE + kv_pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
            ks = tl.load(k_scale + slot, mask=kv_ok, other=0.0)
            k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N], fp32
        if HAS_ALIBI:
            s = s + slope[:, None] * kv_pos[None, :].to(tl.float32)
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        allowed = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        if HAS_WINDOW:
            allowed = allowed & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see no key at all
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk * stride_vb + (kv_pos % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache + v_off[:, None] + dv[None, :], mask=kv_ok[:, None] & dv_ok[None, :], other=0.0)
        if KV_INT8:
            vs = tl.load(v_scale + slot, mask=kv_ok, other=0.0)
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptr = out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
        tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    else:  # unnormalized partials, reduced by _reduce_splits_kernel: [token, head, split, (d)]
        row = ((q_start + tok) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_acc + row[:, None] * DV_P2 + dv[None, :], acc, mask=row_ok[:, None])
        tl.store(part_m + row, m_i, mask=row_ok)
        tl.store(part_l + row, l_i, mask=row_ok)


@triton.jit
def _reduce_splits_kernel(
    part_acc, part_m, part_l, out, sinks, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, V_DIM: tl.constexpr,
    DV_P2: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Combine split-K partials of one (token, head): rescale each by exp(m_s - max m);
    a sink is one more partial, of logit sinks[head], weight 1 and value 0."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    sp_ok = sp < NUM_SPLITS
    d = tl.arange(0, DV_P2)
    base = (t * NUM_HEADS + h) * NUM_SPLITS
    m = tl.load(part_m + base + sp, mask=sp_ok, other=float("-inf"))
    l_s = tl.load(part_l + base + sp, mask=sp_ok, other=0.0)
    acc = tl.load(part_acc + (base + sp)[:, None] * DV_P2 + d[None, :], mask=sp_ok[:, None], other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks + h).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # splits that saw no key weigh nothing
    denom = tl.sum(l_s * w, 0)
    if HAS_SINKS:
        denom = denom + tl.exp(sink - m_max)
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out + t * stride_ot + h * stride_oh + d, o.to(out.dtype.element_ty), mask=d < V_DIM)


def _launch(query, k_cache, v_cache, out, md: AttentionMetadata, p: AttentionParams, first_seq: int, num_seqs: int,
            max_q_len: int, block_q: int, block_n: int, num_splits: int = 1,
            scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    v_dim = v_cache.shape[3]
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    d_p2 = max(16, triton.next_power_of_2(head_dim))
    dv_p2 = max(16, triton.next_power_of_2(v_dim))
    if num_splits > 1:
        rows = query.shape[0] * num_heads * num_splits
        part_acc = torch.empty(rows, dv_p2, device=query.device, dtype=torch.float32)
        part_m = torch.empty(rows, device=query.device, dtype=torch.float32)
        part_l = torch.empty(rows, device=query.device, dtype=torch.float32)
        grid = (num_seqs, num_splits, num_kv_heads)
    else:
        part_acc = part_m = part_l = out  # unused
        grid = (num_seqs, triton.cdiv(max_q_len, block_q), num_kv_heads)
    sinks = p.sinks if p.sinks is not None else out  # unused when absent
    alibi = p.alibi_slopes if p.alibi_slopes is not None else out
    k_scale, v_scale = scales if scales is not None else (out, out)  # unused for float caches
    _paged_attn_kernel[grid](
        query, k_cache, v_cache, out, md.block_tables, md.seq_lens, md.query_start_loc,
        part_acc, part_m, part_l, sinks, alibi, k_scale, v_scale,
        first_seq, p.scale, p.sliding_window or 0, p.softcap or 0.0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), md.block_tables.stride(0),
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, D_P2=d_p2, V_DIM=v_dim, DV_P2=dv_p2,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n,
        # fp32 stays exact IEEE (no TF32) so fp32 runs match the reference tightly
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        NUM_SPLITS=num_splits, NUM_HEADS=num_heads,
        HAS_WINDOW=p.sliding_window is not None, HAS_SOFTCAP=p.softcap is not None,
        HAS_SINKS=p.sinks is not None, HAS_ALIBI=p.alibi_slopes is not None,
        KV_INT8=scales is not None, NUM_KV_HEADS=num_kv_heads,
    )
    if num_splits > 1:  # decodes are the first num_seqs tokens (one per sequence)
        _reduce_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_m, part_l, out, sinks, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits),
            V_DIM=v_dim, DV_P2=dv_p2, HAS_SINKS=p.sinks is not None,
        )


SPLIT_MIN_CONTEXT = 1024  # decode contexts shorter than this never split
SPLIT_TARGET_PROGRAMS = 512  # split until decode programs (seqs x KV heads x splits) reach about this
SPLIT_MAX = 16


def decode_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Flash-decoding heuristic: with few (sequence, KV head) programs and long contexts,
    split each context over several programs so the GPU is filled; 1 = no split."""
    if max_seq_len < SPLIT_MIN_CONTEXT:
        return 1
    programs = max(1, num_decodes * num_kv_heads)
    splits = min(SPLIT_MAX, SPLIT_TARGET_PROGRAMS // programs, max_seq_len // 256)
    return max(1, splits)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    params: AttentionParams | float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of the packed ragged batch through the block tables (K/V of this
    step already written to the cache; `key`/`value` are not read).

    Decodes with long contexts at small batch are split over several programs along the
    context (flash-decoding, Dao et al. 2023) and combined by a second kernel;
    `num_splits` overrides the heuristic (`decode_splits`), for tests. A sliding window
    limits the keys each tile visits (and the split) to the window.

    Args:
        query: `[num_tokens, num_heads, head_dim]`, last dimension contiguous; decodes first.
        k_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`; v_cache: `[..., v_head_dim]`
            (may be a view of k_cache's first channels); last dimensions contiguous.
        md: uses `block_tables` `[num_seqs, max_blocks]` int32, `seq_lens` `[num_seqs]`
            int32 (context after this step), `query_start_loc` `[num_seqs + 1]` int32,
            `num_decodes`, `max_query_len`, `max_seq_len`.
        params: the layer's `AttentionParams` (a float: the softmax scale alone).
        scales: int8 caches' key and value scales `[num_blocks, block_size, num_kv_heads]`
            float32 (`kv_int8.py`), applied as each tile is loaded; None: float caches.

    Returns:
        `[num_tokens, num_heads, v_head_dim]` in query's dtype (fp32 accumulation).

    Raises:
        ValueError: num_heads not a multiple of num_kv_heads.
    """
    p = params if isinstance(params, AttentionParams) else AttentionParams(scale=float(params))
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    assert query.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    out = query.new_empty(query.shape[0], num_heads, v_cache.shape[3])
    group_p2 = triton.next_power_of_2(num_heads // num_kv_heads)
    block_size = k_cache.shape[1]
    block_n = max(64, block_size)
    num_seqs = md.seq_lens.shape[0]
    nd = md.num_decodes
    if nd:  # one query token per sequence: at least 16 rows for tl.dot, mostly the group's heads
        context = min(md.max_seq_len, p.sliding_window or md.max_seq_len)
        splits = num_splits or decode_splits(nd, num_kv_heads, context)
        _launch(query, k_cache, v_cache, out, md, p, 0, nd, 1, max(1, 16 // group_p2), block_n, splits, scales)
    if num_seqs > nd:
        block_q = max(1, 64 // group_p2)
        _launch(query, k_cache, v_cache, out, md, p, nd, num_seqs - nd, md.max_query_len, block_q, block_n,
                scales=scales)
    return out
