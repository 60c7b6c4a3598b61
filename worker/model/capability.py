"""Load-time capability check: decide, before any request, whether the paged runner
reproduces a model exactly, and refuse it at load otherwise (a serving system may not
support a model; it must never answer with wrong tokens).

The rules, in order; the first that fails refuses the model with one line naming the
architecture, the feature and the config field (`UnsupportedModel`):

  1. decoder-only (`config.is_encoder_decoder`), no cross-attention;
  2. every token mixer is softmax attention or a recurrent-state mixer the engine keeps
     per-request state for: `config.layer_types` / `config.layers_block_type` hold only
     attention, feed-forward and recurrent kinds, and every module named like a
     recurrent mixer (Mamba / SSM, linear attention, gated delta net, short convolution,
     RWKV, xLSTM, LRU) takes transformers' linear-attention cache (`state_mixers`; run
     with state slots by `worker.model.recurrent`), or is part of or around one;
  3. no chunked (local) attention (`config.attention_chunk_size`) and no sparse
     top-k indexer (DeepSeek-V3.2's `index_topk`);
  4. then the model is installed for the engine (latent attention: `worker.model.latent`)
     and checked by running it (`worker.model.load_check`).
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module stays importable without torch (the CLI catches UnsupportedModel)
    import torch

# A module whose class name matches keeps state across tokens that is not softmax attention
# (rule 2; `state_mixers` decides which of them the engine runs with state slots).
_RECURRENT_MODULE = re.compile(
    r"Mamba|SSM|Ssm|GatedDeltaNet|DeltaNet|DeltaAttention|DeltaProduct|LinearAttention|LightningAttention|"
    r"ShortConv|Rwkv|RWKV|xLSTM|Xlstm|mLSTM|sLSTM|RecurrentBlock|Rglru|RgLru|Hyena|Retention|GatedConv"
)
# Mixer kinds of `layer_types` / `layers_block_type` that keep per-request state: served
# where the modules are mixers the engine runs with state slots (`check_modules`).
_RECURRENT_KINDS = frozenset({"linear_attention", "mamba", "mamba2", "conv", "hybrid", "linear", "ssm"})
# Mixer kinds of `layer_types` / `layers_block_type` we run; feed-forward kinds carry no state.
ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "attention", "global", "local_attention"})
FEED_FORWARD_KINDS = frozenset({"mlp", "moe", "dense", "sparse", "ffn"})


class UnsupportedModel(ValueError):
    """The model loaded, but the engine cannot reproduce it; raised at load, never per request.

    Attributes:
        model_type: `config.model_type`.
        feature: what is missing, in the field's words (e.g. "linear_attention layers").
        field: the config field (or module) that shows it.
    """

    def __init__(self, model_type: str, feature: str, field: str, detail: str = "") -> None:
        self.model_type, self.feature, self.field = model_type, feature, field
        tail = f": {detail}" if detail else ""
        super().__init__(f"model {model_type!r} has {feature} ({field}); not supported{tail}")


@dataclass(slots=True, frozen=True)
class LayerKV:
    """The KV cache one attention layer needs per token (measured by the load check).

    `value_in_key`: the value is the key cache's first `v_head_dim` channels (latent
    attention), so no separate value tensor is kept.
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    value_in_key: bool = False

    def values_per_token(self) -> int:
        return self.num_kv_heads * (self.head_dim + (0 if self.value_in_key else self.v_head_dim))


@dataclass(slots=True, frozen=True)
class KVLayout:
    """Per layer (by `layer_idx`) the KV cache shape; None for a layer without attention.

    `sliding_window`: W when every attention layer is windowed (the engine then frees KV
    blocks no layer can read any more); None when any layer attends to the whole context.
    """

    layers: tuple[LayerKV | None, ...]
    sliding_window: int | None = None

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVLayout:
        return cls(tuple(LayerKV(num_kv_heads, head_dim, head_dim) for _ in range(num_layers)))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def bytes_per_token(self, dtype: torch.dtype, kv_int8: bool = False) -> int:
        """KV cache bytes one token takes over all layers: in `dtype`, or in int8 with a
        float32 scale per KV head for keys and for values (`kernels/kv_int8.py`)."""
        layers = [layer for layer in self.layers if layer is not None]
        if kv_int8:
            return sum(layer.values_per_token() + 2 * 4 * layer.num_kv_heads for layer in layers)
        return dtype.itemsize * sum(layer.values_per_token() for layer in layers)


def layer_windows(text_cfg) -> list[int | None]:
    """Sliding window per layer as transformers' masks apply it: `layer_types` where the
    config has it (Gemma 2/3, GPT-OSS, Qwen2 with use_sliding_window, Cohere 2, OLMo 3 …),
    else `sliding_window` on every layer unless `use_sliding_window` is false (Mistral,
    Phi-3, StarCoder2)."""
    n = int(text_cfg.num_hidden_layers)
    window = getattr(text_cfg, "sliding_window", None)
    types = getattr(text_cfg, "layer_types", None)
    if types:
        return [int(window) if t == "sliding_attention" and window else None for t in types[:n]]
    if window and getattr(text_cfg, "use_sliding_window", True) is not False:
        return [int(window)] * n
    return [None] * n


def layer_kind(text_cfg, layer_idx: int) -> str | None:
    """Layer `layer_idx`'s kind as the config names it (`layer_types` or
    `layers_block_type`), or None where it names none."""
    for field in ("layer_types", "layers_block_type"):
        kinds = getattr(text_cfg, field, None) or []
        if layer_idx < len(kinds):
            return str(kinds[layer_idx])
    return None


def check_config(text_cfg, model_type: str) -> None:
    """Rules 1–3 on the config alone (before the weights load).

    Raises:
        UnsupportedModel: see the module docstring.
    """
    if getattr(text_cfg, "is_encoder_decoder", False):
        raise UnsupportedModel(model_type, "an encoder-decoder architecture", "config.is_encoder_decoder")
    if getattr(text_cfg, "add_cross_attention", False):
        raise UnsupportedModel(model_type, "cross-attention layers", "config.add_cross_attention")
    for field in ("layer_types", "layers_block_type"):
        kinds = getattr(text_cfg, field, None) or []
        for i, kind in enumerate(kinds):
            kind_s = str(kind)
            if kind_s not in ATTENTION_KINDS and kind_s not in FEED_FORWARD_KINDS and kind_s not in _RECURRENT_KINDS:
                raise UnsupportedModel(model_type, f"{kind_s} layers", f"config.{field}[{i}]", _why(kind_s))
    if getattr(text_cfg, "attention_chunk_size", None):
        raise UnsupportedModel(model_type, "chunked local attention", "config.attention_chunk_size")
    if getattr(text_cfg, "index_topk", None):
        raise UnsupportedModel(model_type, "a sparse attention indexer (top-k tokens per query)", "config.index_topk")


def check_modules(model: torch.nn.Module, model_type: str) -> None:
    """Rule 2 on the modules actually instantiated (catches hybrids whose config has no
    layer-kind field, e.g. Falcon-H1's parallel Mamba heads): every module named like a
    recurrent-state mixer is one the engine runs with its state slots (`state_mixers`), a
    block around one, a part of one, a stateless normalization, or softmax attention
    through transformers' attention interface whatever its name.

    Raises:
        UnsupportedModel: the first recurrent-state module found that is none of those,
            by its dotted name.
    """
    mixers = tuple(state_mixers(model))
    for name, module in model.named_modules():
        cls = type(module).__name__
        if _RECURRENT_MODULE.search(cls) and "Norm" not in cls and not _uses_attention_interface(type(module)) \
                and not any(name == m or m.startswith(f"{name}.") or not name or name.startswith(f"{m}.")
                            for m in mixers):
            raise UnsupportedModel(model_type, f"recurrent-state layers ({cls})", f"module {name or '(the model)'}",
                                   _RECURRENT_WHY)
        if hasattr(module, "crossattention") or hasattr(module, "encoder_attn"):
            raise UnsupportedModel(model_type, "cross-attention layers", f"module {name}")


def state_mixers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The recurrent mixers the engine runs: modules that hold a `layer_idx` and whose
    forward takes transformers' `cache` and reads or writes its per-layer states
    (`is_state_mixer`). name -> module."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "layer_idx", None), int) and is_state_mixer(type(m))}


@functools.cache
def is_state_mixer(cls: type) -> bool:
    """`cls.forward` takes `cache` and calls the cache's state interface itself (a block
    that only passes `cache` on to its mixer does not)."""
    forward = getattr(cls, "forward", None)
    try:
        params = inspect.signature(forward).parameters
        source = inspect.getsource(forward)
    except (TypeError, ValueError, OSError):
        return False
    return "cache" in params and any(f"cache.{m}(" in source for m in _STATE_METHODS)


@functools.cache
def _uses_attention_interface(cls: type) -> bool:
    """`cls.forward` calls transformers' attention interface: softmax attention whatever its
    name says (Kimi-Linear's full-attention layers are `KimiLinearAttention`); the shape
    pass checks it like any attention module."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (TypeError, ValueError, OSError):
        return False


_STATE_METHODS = ("get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state",
                  "get_linear_cache", "set_linear_cache")


_LAYER_INDEX = re.compile(r"\.\d+\.")


def decoder_projections(model: torch.nn.Module, kinds: tuple[type, ...]) -> dict[str, torch.nn.Module]:
    """The projections of the decoder layers that take per-projection treatment (LoRA
    deltas, quantization): modules of exactly one of `kinds` whose name has a layer index,
    not MoE experts (they see a subset of the tokens, not the packed batch) and not the
    output embedding. name -> module, in `named_modules` order."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: m for name, m in model.named_modules()
            if type(m) in kinds and m is not head and "expert" not in name and _LAYER_INDEX.search(f".{name}.")}


_RECURRENT_WHY = ("they carry per-request recurrent state the engine keeps only for mixers that take "
                 "transformers' linear-attention cache (worker/model/recurrent.py; docs/models.md lists the families)")


def _why(kind: str) -> str:
    if kind == "chunked_attention":
        return "chunked local attention is not implemented by the paged back ends"
    if kind in ("linear_attention", "mamba", "mamba2", "recurrent", "conv", "hybrid", "linear", "rwkv", "ssm"):
        return _RECURRENT_WHY
    return "the paged runner implements only full and sliding-window softmax attention layers"
