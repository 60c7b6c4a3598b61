"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434) over a latent KV cache.

An MLA layer compresses each token's keys and values into one latent vector
`c = kv_a_layernorm(...)` of `kv_lora_rank` channels plus one shared rotary key `k_pe`
of `qk_rope_head_dim` channels; per head, `k_nope = W_uk c` and `v = W_uv c`
(`kv_b_proj`). transformers' MLA modules keep the latent until `expand_kv`, which
decompresses it into full per-head K/V. We cache the latent itself, as vLLM's MLA back
ends do, one vector per token per layer:

    latent cache   [num_blocks, block_size, 1, kv_lora_rank + rope_dim]     (K)
    value view     latent[..., :kv_lora_rank]                                (V, no copy)

and attend in latent space by absorbing the up-projections (the paper's §2.1.2):
`q_nope · (W_uk c) = (W_uk^T q_nope) · c` and `softmax(...) (W_uv c) = W_uv (softmax(...) c)`,
so the step is multi-query attention with one KV head of `kv_lora_rank + rope_dim`
channels and values of `kv_lora_rank` channels, followed by `W_uv` per head.

KV bytes per token and layer: `(kv_lora_rank + rope_dim) * elt`, against
`num_heads * (qk_head_dim + v_head_dim) * elt` for the decompressed layout (DeepSeek-V3:
576 vs 40 960 values, 71x less).
"""

from __future__ import annotations

from types import MethodType
from typing import TYPE_CHECKING

import torch

from worker.model.kernels.params import AttentionParams

if TYPE_CHECKING:
    from worker.model.attention import AttentionMetadata

ATTRS = ("kv_b_proj", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_heads")


def is_latent_module(module: torch.nn.Module) -> bool:
    """An MLA module in transformers' shape: keeps the latent until `expand_kv`."""
    return callable(getattr(type(module), "expand_kv", None)) and all(hasattr(module, a) for a in ATTRS)


class LatentAttention:
    """The latent path of one MLA module (installed by `install`; read by the attention function).

    Raises (at construction):
        ValueError: `kv_b_proj` is not a plain floating-point linear layer (e.g. quantized).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        proj = module.kv_b_proj
        if not isinstance(proj, torch.nn.Linear) or not proj.weight.is_floating_point() or proj.bias is not None:
            raise ValueError(f"{type(module).__name__}.kv_b_proj is {type(proj).__name__} "
                             f"({getattr(proj.weight, 'dtype', '?')}); the latent KV cache needs a plain linear layer")
        self.proj = proj
        proj.inflight_reads_weight = True  # `attend` reads the weight itself: it keeps its plain layout
        self.rank = int(module.kv_lora_rank)
        self.rope_dim = int(module.qk_rope_head_dim)
        self.nope_dim = int(module.qk_nope_head_dim)
        self.v_dim = int(module.v_head_dim)
        self.num_heads = int(module.num_heads)

    @property
    def latent_dim(self) -> int:
        return self.rank + self.rope_dim

    def attend(self, query: torch.Tensor, latent: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               md: AttentionMetadata, params: AttentionParams) -> torch.Tensor:
        """Write the step's latents and attend in latent space.

        Args:
            query: `[num_tokens, num_heads, qk_nope_head_dim + rope_dim]` (rotary applied).
            latent: `[num_tokens, 1, kv_lora_rank + rope_dim]`: normalized c, then rotated k_pe.
            k_cache: `[num_blocks, block_size, 1, kv_lora_rank + rope_dim]`; v_cache: its
                `[..., :kv_lora_rank]` view.

        Returns:
            `[1, num_tokens, num_heads, v_head_dim]`.
        """
        w = self.proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        q_latent = torch.einsum("thn,hnr->thr", query[..., : self.nope_dim], w[:, : self.nope_dim])
        q = torch.cat([q_latent, query[..., self.nope_dim :]], dim=-1).contiguous()
        md.backend.write_kv(latent, None, k_cache, v_cache, md.slot_mapping)
        out = md.backend.paged_attention(q, latent, latent[..., : self.rank], k_cache, v_cache, md, params)
        return torch.einsum("thr,hvr->thv", out, w[:, self.nope_dim :]).unsqueeze(0)


def _expand_latent(self: torch.nn.Module, kv_nope: torch.Tensor, k_rot: torch.Tensor):
    """Instance override of `expand_kv`: under our attention, hand the latent through
    (as a one-head key) instead of decompressing it; under any other (the load check's
    reference), the model's own decompression."""
    from worker.model.attention import ATTN_IMPLEMENTATION

    if getattr(self.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return type(self).expand_kv(self, kv_nope, k_rot)
    latent = torch.cat([kv_nope, k_rot], dim=-1)  # [batch, 1, seq, rank + rope]
    return latent, latent[..., : self.kv_lora_rank]


def install(model: torch.nn.Module) -> dict[int, LatentAttention]:
    """Switch every MLA module of `model` to the latent path. Returns layer_idx -> adapter.

    Raises:
        ValueError: see `LatentAttention`.
    """
    found: dict[int, LatentAttention] = {}
    for module in model.modules():
        if is_latent_module(module):
            adapter = LatentAttention(module)
            module.inflight_latent = adapter
            module.expand_kv = MethodType(_expand_latent, module)
            found[int(module.layer_idx)] = adapter
    return found
