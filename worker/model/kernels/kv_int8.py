"""The KV cache in int8 (`serving_tuning.kv_cache_dtype: int8`): each token's key and value
of each KV head rounded to int8 with a scale of its own, `max|x| / 127` (symmetric; the
per-token-head dynamic scheme of vLLM's and TensorRT-LLM's int8 KV caches), stored beside
the values in a float32 scale cache `[num_blocks, block_size, num_kv_heads]`. No
calibration: a scale per written row follows the values wherever they go.

Bytes per token and layer: `num_kv_heads x (head_dim + v_head_dim + 8)` against 4x (fp32)
or 2x (bf16) the values alone: 3.8x the tokens of an fp32 cache of the same bytes at head
size 64, 1.9x of a bf16 one.

Read by every back end: the torch reference gathers dequantized blocks
(`torch_ref.paged_attention(..., scales=...)`), the C decode kernel reads the int8 values
and their scales in place, the Triton kernel dequantizes each tile as it loads it and
writes with `triton_attn.write_kv_int8` (no host sync, so decode graphs can hold it).
Latent (MLA) caches refuse it at start (`worker.engine.engine`).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 per token, KV head and cache (keys, values)


def allocate_scales(num_blocks: int, block_size: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """A zeroed scale cache `[num_blocks, block_size, num_kv_heads]` float32."""
    return torch.zeros((num_blocks, block_size, num_kv_heads), dtype=torch.float32, device=device)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[tokens, heads, dim]` -> int8 values of the same shape and float32 scales
    `[tokens, heads]` (`max|x| / 127` per token and head; a row of zeros gets the smallest
    positive scale), each value `floor(x / scale + 0.5)`: the rule the Triton write kernel
    (`triton_attn.write_kv_int8`) computes too, so both back ends store the same bytes."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.floor(xf / scale[..., None] + 0.5).clamp(-127, 127).to(torch.int8), scale


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """`x` `[tokens, heads, dim]` as the int8 cache holds it (quantized, dequantized),
    float32: what a chunk with no cached context attends to, as it would read it back."""
    q, scale = quantize(x)
    return q.float() * scale[..., None]


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             scales: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor) -> None:
    """`torch_ref.write_kv`'s contract for int8 caches: the step's K/V `[tokens, kv_heads,
    dim]` quantized and scattered to their slots, with their scales (`scales`: the layer's
    key and value scale caches). Negative slots (padding) are skipped."""
    if bool((slot_mapping < 0).any()):
        written = slot_mapping >= 0
        key, value, slot_mapping = key[written], value[written], slot_mapping[written]
    for x, cache, scale in ((key, k_cache, scales[0]), (value, v_cache, scales[1])):
        q, s = quantize(x)
        nb, bs = cache.shape[:2]
        cache.view(nb * bs, *cache.shape[2:]).index_copy_(0, slot_mapping, q)
        scale.view(nb * bs, scale.shape[2]).index_copy_(0, slot_mapping, s)


def gather(cache: torch.Tensor, scale: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`torch_ref._gather` for an int8 cache: `[..., nblocks]` block ids ->
    `[..., nblocks * block_size, heads, dim]` float32, dequantized."""
    ids = block_ids.reshape(-1)
    values = torch.index_select(cache, 0, ids).float()
    values.mul_(torch.index_select(scale, 0, ids)[..., None])
    return values.view(*block_ids.shape[:-1], block_ids.shape[-1] * cache.shape[1], *cache.shape[2:])
