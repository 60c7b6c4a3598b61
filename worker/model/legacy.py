"""Adapters for architectures whose attention modules compute attention themselves
instead of calling transformers' attention interface (BLOOM, Falcon): their forward is
replaced, per instance, by one that uses the module's own projections and positions and
then our paged attention.

These models do not pass keyword arguments down to their attention modules, so the
step's `AttentionMetadata` reaches the adapters through `attention.current_metadata()`,
which the runner sets around each forward (a wrapper of the model's `forward` keeps the
`inflight_metadata` argument away from a signature that may not take it). Under any
other attention implementation (the load check's eager reference) the adapters run the
module's original forward.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch

from worker.model.attention import (
    ATTN_IMPLEMENTATION,
    AttentionMetadata,
    current_metadata,
    paged_attention_forward,
    step_metadata,
)
from worker.model.capability import UnsupportedModel


def _active(module: torch.nn.Module) -> AttentionMetadata | None:
    cfg = getattr(module, "config", None) or module.inflight_config
    if getattr(cfg, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return None
    return current_metadata()


def _bloom_attention(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                     output_attentions=False, **kwargs):
    """BloomAttention.forward over the paged cache: ALiBi (per-head slopes x key position) + q·k / sqrt(d)."""
    md = _active(self)
    if md is None:
        return type(self).forward(self, hidden_states, residual, alibi, attention_mask, layer_past, use_cache,
                                  output_attentions, **kwargs)
    batch, num_tokens, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # each [1, heads, tokens, head_dim]
    ctx, _ = paged_attention_forward(self, q, k, v, None, scaling=self.inv_norm_factor, inflight_metadata=md)
    ctx = ctx.reshape(batch, num_tokens, self.num_heads * self.head_dim)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        out = torch.zeros_like(ctx)
        for i in range(self.pretraining_tp):
            lo, hi = int(i * slices), int((i + 1) * slices)
            out = out + torch.nn.functional.linear(ctx[:, :, lo:hi], self.dense.weight[:, lo:hi])
    else:
        out = self.dense(ctx)
    modeling = sys.modules[type(self).__module__]
    return modeling.dropout_add(out, residual, self.hidden_dropout, self.training), None


def _falcon_attention(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
                      use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
    """FalconAttention.forward (rotary variants) over the paged cache: multi-query, the
    new decoder architecture's grouped K/V (one copy per KV head, not the broadcast), or
    full multi-head."""
    md = _active(self)
    if md is None:
        return type(self).forward(self, hidden_states, alibi, attention_mask, position_ids, layer_past, use_cache,
                                  output_attentions, position_embeddings, **kwargs)
    q, k, v = self._split_heads(self.query_key_value(hidden_states))  # [batch, tokens, heads, head_dim]
    if self.new_decoder_architecture:  # K/V were broadcast over each group: keep one per KV head
        group = self.num_heads // self.num_kv_heads
        k, v = k[:, :, ::group], v[:, :, ::group]
    batch, num_tokens = q.shape[:2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    modeling = sys.modules[type(self).__module__]
    cos, sin = position_embeddings
    q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    ctx, _ = paged_attention_forward(self, q, k, v.contiguous(), None, scaling=self.head_dim ** -0.5,
                                     inflight_metadata=md)
    return self.dense(ctx.reshape(batch, num_tokens, self.num_heads * self.head_dim)), None


def _install_bloom(model: torch.nn.Module) -> list[str]:
    modeling = sys.modules[type(model).__module__]
    for module in model.modules():
        if type(module).__name__ == "BloomAttention":
            module.forward = MethodType(_bloom_attention, module)
            module.inflight_config = model.config
            module.inflight_alibi_slopes = modeling._get_alibi_slopes(module.num_heads, next(module.parameters()).device)
            module.dense.inflight_reads_weight = True  # sliced by `_bloom_attention` (pretraining_tp > 1)
    return ["attention outside the interface (adapter: BloomAttention)"]


def _install_falcon(model: torch.nn.Module) -> list[str]:
    cfg = model.config
    if cfg.alibi:
        raise UnsupportedModel("falcon", "ALiBi Falcon attention", "config.alibi",
                               "only the rotary Falcon variants are adapted")
    for module in model.modules():
        if type(module).__name__ in ("FalconAttention", "FalconFlashAttention2"):
            module.forward = MethodType(_falcon_attention, module)
    return ["attention outside the interface (adapter: FalconAttention)"]


_ADAPTERS: dict[str, Callable[[torch.nn.Module], list[str]]] = {"bloom": _install_bloom, "falcon": _install_falcon}


def has_adapter(model_type: str) -> bool:
    return model_type in _ADAPTERS


def _install_shared_attention(model: torch.nn.Module) -> list[str]:
    """Attention modules shared by several layers (Zamba, Zamba2: one block's weights
    called from every hybrid layer) take the calling layer's index as a `layer_idx`
    argument, and their own `layer_idx` attribute (which our attention reads to pick the
    KV cache) names none of those layers: each call sets the attribute to its argument
    first, so every calling layer has its own KV cache."""
    shared = [m for m in model.modules() if "ttention" in type(m).__name__ and hasattr(m, "layer_idx")
              and "layer_idx" in _forward_params(type(m))]
    for module in shared:
        module.forward = _per_call_layer(module, inspect.signature(type(module).forward))
    return [f"attention shared by several layers ({type(shared[0]).__name__}: a KV cache per calling layer)"] \
        if shared else []


def _forward_params(cls: type) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return ()


def _per_call_layer(module: torch.nn.Module, signature: inspect.Signature):
    inner = type(module).forward.__get__(module)

    def forward(*args: Any, **kwargs: Any):
        idx = signature.bind_partial(module, *args, **kwargs).arguments.get("layer_idx")
        if isinstance(idx, int):
            module.layer_idx = idx
        return inner(*args, **kwargs)

    return forward


def install(model: torch.nn.Module) -> list[str]:
    """Install the adapter of `model`'s architecture, if it has one (after the model is
    on its device), and make attention modules shared by several layers keep a KV cache
    per calling layer. Returns the features they add, for the load verdict.

    Raises:
        UnsupportedModel: a variant the adapter does not cover.
    """
    shared = _install_shared_attention(model)
    installer = _ADAPTERS.get(str(model.config.model_type))
    if installer is None:
        return shared
    features = shared + installer(model)
    inner = model.forward

    def forward(*args: Any, inflight_metadata: AttentionMetadata | None = None, **kwargs: Any):
        if inflight_metadata is None:
            return inner(*args, **kwargs)
        with step_metadata(inflight_metadata):
            return inner(*args, **kwargs)

    model.forward = forward
    return features


def use_paged_attention(model: torch.nn.Module) -> None:
    """A model built with `eager` because its constructor picks attention classes by
    name: switch its configs to our implementation (the adapter does the rest)."""
    for module in [model, *model.modules()]:
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTN_IMPLEMENTATION
