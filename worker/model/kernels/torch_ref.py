"""Plain-torch paged attention: the reference back end (CPU, tests) and the contract
every other back end (Triton on CUDA) must match.

Cache layout, per layer: `k_cache` `[num_blocks, block_size, num_kv_heads, head_dim]` and
`v_cache` `[num_blocks, block_size, num_kv_heads, v_head_dim]`; token slot s lives at
`cache[s // block_size, s % block_size]`, with `s = block_id * block_size + offset`.
`v_cache` may be a view of `k_cache`'s first `v_head_dim` channels (latent attention,
where the value is part of the cached latent); `write_kv` then gets `value=None`.

Beyond the plain causal softmax, `AttentionParams` adds per layer: a sliding window,
logit soft-capping, attention sinks and ALiBi. The plain case uses SDPA; any of those
switches to an explicit fp32 softmax, the order of operations of transformers' eager
attention (scale, ALiBi, cap, mask, sinks, softmax).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from worker.model.kernels import kv_int8
from worker.model.kernels.params import AttentionParams

if TYPE_CHECKING:
    from worker.model.attention import AttentionMetadata

READS_INT8_KV = True  # int8 caches with their scales (kv_int8.py)


def write_kv(
    key: torch.Tensor, value: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V into the paged cache.

    Args:
        key: `[num_tokens, num_kv_heads, head_dim]`; value: `[num_tokens, num_kv_heads, v_head_dim]`,
            or None when the value lives inside the key cache (latent attention).
        k_cache, v_cache: as in the module docstring, written in place.
        slot_mapping: `[num_tokens]` int64 slot of each token; negative slots (the padding
            rows of a decode graph's batch, `worker.model.graphs`) are skipped on the CPU
            (on CUDA only Triton's kernel skips them: here that would cost a host sync).
    """
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    if not slot_mapping.is_cuda and bool((slot_mapping < 0).any()):
        written = slot_mapping >= 0
        key, slot_mapping = key[written], slot_mapping[written]
        value = None if value is None else value[written]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    if value is not None:
        v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(
            0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`[..., nblocks]` block ids → `[..., nblocks * block_size, heads, dim]` (a copy).
    `index_select` over the flat ids: on the CPU 2.2x faster than `cache[block_ids]`
    (32 x 20 blocks of 16 x 4 x 32: 260 vs 579 us), the same values. `scale`: an int8
    cache's scales (`kv_int8`): the copy is dequantized, float32."""
    if scale is not None:
        return kv_int8.gather(cache, scale, block_ids)
    flat = torch.index_select(cache, 0, block_ids.reshape(-1))
    return flat.view(*block_ids.shape[:-1], block_ids.shape[-1] * cache.shape[1], *cache.shape[2:])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, p: AttentionParams,
            k_pos: torch.Tensor, head_index: torch.Tensor) -> torch.Tensor:
    """Explicit softmax attention with fp32 logits, over 4-d batches `[A, B, Tq, Tk]`.

    Args:
        q: `[A, B, Tq, D]`; k: `[A, B or 1, Tk, D]`; v: `[A, B or 1, Tk, Dv]`.
        allowed: bool, broadcastable to `[A, B, Tq, Tk]` (True = attend).
        k_pos: absolute key positions, broadcastable to `[A, B, Tq, Tk]` (ALiBi).
        head_index: int, broadcastable to `[A, B, Tq, 1]`: the query head of each row
            (sinks and ALiBi slopes are per head).

    Returns:
        `[A, B, Tq, Dv]` in q's dtype.
    """
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * p.scale
    if p.alibi_slopes is not None:
        s = s + p.alibi_slopes.float()[head_index] * k_pos.float()
    if p.softcap is not None:
        s = torch.tanh(s / p.softcap) * p.softcap
    s = s.masked_fill(~allowed, float("-inf"))
    if p.sinks is not None:
        sink = p.sinks.float()[head_index].expand(*s.shape[:-1], 1)
        probs = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        m = s.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)  # rows with no key: all -inf
        e = torch.exp(s - m)
        probs = e / e.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.matmul(probs, v.float()).to(q.dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    params: AttentionParams | float,
    out: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of a packed ragged batch over the paged cache (K/V already written).

    Args:
        query: `[num_tokens, num_heads, head_dim]`; the first `md.num_decodes` tokens are
            decodes (one per sequence), then each prefill chunk's tokens in order.
        key, value: `[num_tokens, num_kv_heads, head_dim / v_head_dim]`, this step's K/V
            (used directly by chunks that have no earlier context).
        k_cache, v_cache: see the module docstring.
        md: the step's AttentionMetadata.
        params: the layer's `AttentionParams` (a float: the softmax scale alone).
        out: where to write the result (rows of sequences not in `md` left as they are);
            None: a new tensor.
        scales: the key and value scale caches of int8 caches (`kv_int8`); None: float caches.

    Returns:
        `[num_tokens, num_heads, v_head_dim]` (`out` when given). Grouped-query attention when num_heads is a
        multiple of num_kv_heads (query head h reads KV head h // (num_heads / num_kv_heads)).
    """
    p = params if isinstance(params, AttentionParams) else AttentionParams(scale=float(params))
    if out is None:
        out = query.new_empty(query.shape[0], query.shape[1], v_cache.shape[-1])
    ks, vs = scales if scales is not None else (None, None)
    groups, prefills = md.dense()
    for g in groups:
        out[g.row_start : g.row_end] = _decode_group(query, k_cache, v_cache, md, g, p, ks, vs)
    for span in prefills:
        out[span.q_start : span.q_end] = _prefill_span(query, key, value, k_cache, v_cache, span, p, ks, vs)
    return out


def _decode_group(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                  g, p: AttentionParams, ks: torch.Tensor | None = None, vs: torch.Tensor | None = None) -> torch.Tensor:
    """One group of decodes (`md.decode_groups`): `[rows, num_heads, v_head_dim]`. Whole
    blocks are gathered (contiguous copies), then the padding past each context is
    masked. GQA without repeating K/V: the query heads sharing a KV head act as that
    head's `group` query rows (head h = kv_head * group + i)."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, v_dim = k_cache.shape[2], v_cache.shape[-1]
    group = num_heads // num_kv_heads
    rows = g.row_end - g.row_start
    k = _gather(k_cache, g.block_ids, ks).transpose(1, 2)  # [rows, KVH, ctx, D]
    v = _gather(v_cache, g.block_ids, vs).transpose(1, 2)
    q = query[g.row_start : g.row_end].reshape(rows, num_kv_heads, group, head_dim)
    allowed = g.mask  # [rows, 1, 1, ctx]
    if p.sliding_window is not None:
        seq_lens = md.seq_lens[g.row_start : g.row_end].view(rows, 1, 1, 1).long()
        pos = torch.arange(allowed.shape[-1], device=query.device)
        allowed = allowed & (pos >= seq_lens - p.sliding_window)
    if not p.changes_logits:  # SDPA with a mask; else the explicit softmax
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed, scale=p.scale)
    else:
        heads = torch.arange(num_heads, device=query.device).view(1, num_kv_heads, group, 1)
        k_pos = torch.arange(allowed.shape[-1], device=query.device).view(1, 1, 1, -1)
        o = _attend(q, k, v, allowed, p, k_pos, heads)
    return o.reshape(rows, num_heads, v_dim)


def _prefill_span(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, span, p: AttentionParams, ks: torch.Tensor | None = None,
                  vs: torch.Tensor | None = None) -> torch.Tensor:
    """One prefill chunk (`md.prefills`): `[q_len, num_heads, v_head_dim]`, causal over
    its earlier context in the cache (or this chunk's own K/V when it has none)."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, v_dim = k_cache.shape[2], v_cache.shape[-1]
    group = num_heads // num_kv_heads
    window = p.sliding_window
    q_len = span.q_end - span.q_start
    q = query[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    if span.ctx_block_ids is None:  # no earlier context: attend to this chunk only
        k = key[span.q_start : span.q_end]
        v = value[span.q_start : span.q_end]
        if ks is not None:  # an int8 cache: the values it holds, as every other read sees them
            k, v = kv_int8.round_trip(k).to(k.dtype), kv_int8.round_trip(v).to(v.dtype)
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        start, ctx = 0, q_len
        allowed = None
    else:
        ctx = span.mask.shape[1]
        start = ctx - q_len
        k = _gather(k_cache, span.ctx_block_ids, ks)[:ctx].transpose(0, 1).unsqueeze(0)
        v = _gather(v_cache, span.ctx_block_ids, vs)[:ctx].transpose(0, 1).unsqueeze(0)
        allowed = span.mask
    plain = not p.changes_logits
    if plain and window is None and allowed is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=p.scale, enable_gqa=group > 1)
    else:
        q_pos = torch.arange(start, ctx, device=query.device).view(-1, 1)
        k_pos = torch.arange(ctx, device=query.device).view(1, -1)
        if allowed is None:
            allowed = k_pos <= q_pos
        if window is not None:
            allowed = allowed & (k_pos > q_pos - window)
        if plain:
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed,
                                               scale=p.scale, enable_gqa=group > 1)
        else:
            qg = q.reshape(num_kv_heads, group, q_len, head_dim)  # the query heads of one KV head together
            heads = torch.arange(num_heads, device=query.device).view(num_kv_heads, group, 1, 1)
            o = _attend(qg, k[0].unsqueeze(1), v[0].unsqueeze(1), allowed, p, k_pos, heads)
            o = o.view(1, num_heads, q_len, v_dim)
    return o[0].transpose(0, 1)
