"""Plain-torch paged attention: the reference back end (CPU, tests) and the contract
every other back end (Triton on CUDA) must match.

Cache layout, per layer: `k_cache`, `v_cache` of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`; token slot s lives at
`cache.view(-1, num_kv_heads, head_dim)[s]`, with `s = block_id * block_size + offset`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from worker.model.attention import AttentionMetadata


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter this step's K/V into the paged cache.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, written in place.
        slot_mapping: `[num_tokens]` int64 slot of each token.
    """
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a packed ragged batch over the paged cache (K/V already written).

    Args:
        query: `[num_tokens, num_heads, head_dim]`; the first `md.num_decodes` tokens are
            decodes (one per sequence), then each prefill chunk's tokens in order.
        key, value: `[num_tokens, num_kv_heads, head_dim]`, this step's K/V (used directly
            by chunks that have no earlier context).
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`.
        md: the step's AttentionMetadata.
        scale: softmax scale (usually head_dim ** -0.5).

    Returns:
        `[num_tokens, num_heads, head_dim]`. Grouped-query attention when num_heads is a
        multiple of num_kv_heads.
    """
    num_kv_heads = k_cache.shape[2]
    gqa = query.shape[1] != num_kv_heads
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // num_kv_heads
    for g in md.decode_groups:
        # Gather whole blocks (contiguous copies), then mask the padding past each context.
        k = k_cache[g.block_ids].flatten(1, 2).transpose(1, 2).to(query.dtype)  # [rows, KVH, ctx, Dh]
        v = v_cache[g.block_ids].flatten(1, 2).transpose(1, 2).to(query.dtype)
        rows = g.row_end - g.row_start
        # GQA without repeating K/V: the query heads sharing a KV head act as that head's
        # `group` query rows (head h = kv_head * group + i), ~25 % faster than enable_gqa here
        q = query[g.row_start : g.row_end].reshape(rows, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
        out[g.row_start : g.row_end] = o.reshape(rows, num_heads, head_dim)
    for span in md.prefills:
        q = query[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, Dh]
        if span.ctx_block_ids is None:  # no earlier context: attend to this chunk only
            k = key[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)
            v = value[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            ctx = span.mask.shape[1]
            k = k_cache[span.ctx_block_ids].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0).to(query.dtype)
            v = v_cache[span.ctx_block_ids].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0).to(query.dtype)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scale, enable_gqa=gqa)
        out[span.q_start : span.q_end] = o[0].transpose(0, 1)
    return out
