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
to the whole context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from worker.model.attention import AttentionMetadata

USES_DENSE_METADATA = False  # the runner may skip the reference back end's padded groups and masks


@triton.jit
def _write_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_P2: tl.constexpr, D_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
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
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    k = tl.load(key + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
    v = tl.load(value + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V into the paged cache (one program per token).

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, last dimension contiguous.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, written in place.
        slot_mapping: `[num_tokens]` int64 slot of each token; negative slots are skipped.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        H_P2=triton.next_power_of_2(num_kv_heads), D_P2=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1],
    )


@triton.jit
def _paged_attn_kernel(
    query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
    seq_offset, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, D_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0) + seq_offset
    q_tile = tl.program_id(1)
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
    q_ptr = query + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx_len - q_len + tok  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    last_tok = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    kv_end = ctx_len - q_len + last_tok + 1  # keys this tile can see
    n = tl.arange(0, BLOCK_N)
    for start in range(0, kv_end, BLOCK_N):
        kv_pos = start + n
        kv_ok = kv_pos < kv_end
        blk = tl.load(block_tables + seq * stride_bt + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0)
        kv_off = blk.to(tl.int64) * stride_cb + (kv_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N], fp32
        s = tl.where((kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see no key at all
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptr = out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _launch(query, k_cache, v_cache, out, md: AttentionMetadata, scale: float, first_seq: int, num_seqs: int,
            max_q_len: int, block_q: int, block_n: int) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    grid = (num_seqs, triton.cdiv(max_q_len, block_q), num_kv_heads)
    _paged_attn_kernel[grid](
        query, k_cache, v_cache, out, md.block_tables, md.seq_lens, md.query_start_loc,
        first_seq, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), md.block_tables.stride(0),
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, D_P2=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n,
        # fp32 stays exact IEEE (no TF32) so fp32 runs match the reference tightly
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the packed ragged batch through the block tables (K/V of this
    step already written to the cache; `key`/`value` are not read).

    Args:
        query: `[num_tokens, num_heads, head_dim]`, last dimension contiguous; decodes first.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous.
        md: uses `block_tables` `[num_seqs, max_blocks]` int32, `seq_lens` `[num_seqs]`
            int32 (context after this step), `query_start_loc` `[num_seqs + 1]` int32,
            `num_decodes`, `max_query_len`.
        scale: softmax scale.

    Returns:
        `[num_tokens, num_heads, head_dim]` in query's dtype (fp32 accumulation).

    Raises:
        ValueError: num_heads not a multiple of num_kv_heads.
    """
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty_like(query)
    group_p2 = triton.next_power_of_2(num_heads // num_kv_heads)
    block_size = k_cache.shape[1]
    block_n = max(64, block_size)
    num_seqs = md.seq_lens.shape[0]
    nd = md.num_decodes
    if nd:  # one query token per sequence: at least 16 rows for tl.dot, mostly the group's heads
        _launch(query, k_cache, v_cache, out, md, scale, 0, nd, 1, max(1, 16 // group_p2), block_n)
    if num_seqs > nd:
        block_q = max(1, 64 // group_p2)
        _launch(query, k_cache, v_cache, out, md, scale, nd, num_seqs - nd, md.max_query_len, block_q, block_n)
    return out
