"""Our paged attention, plugged into transformers models through the
attention-function registry (`AttentionInterface`), the way vLLM's Transformers
back end does it: transformers owns the model definition (projections, RoPE or
learned positions, MLP), we own the KV layout and the packed batch.

The model is called with the whole step as one "sequence" of `num_tokens` tokens
(`input_ids` `[1, num_tokens]`, per-sequence `position_ids`), `use_cache=False`, and
`inflight_metadata=AttentionMetadata(...)`, which transformers forwards to every
attention call. Since the implementation name is not in transformers' mask registry,
no dense mask is built. What a layer asks for beyond the causal softmax arrives as the
call's keyword arguments (`sliding_window`, `softcap`, `s_aux` = sinks) and becomes
that call's `AttentionParams`. Latent attention (MLA) arrives already compressed: see
`worker.model.latent`.

Under `torch.compile` or an ahead-of-time capture (`worker.model.compiled`) the same
function is traced, and there it only calls `torch.ops.inflight.attention`
(`attention_op`), an opaque op that runs the eager path above when the compiled graph
runs. The op names its attention module by `layer_idx`, a constant of the graph that is
the same in every process, and finds the module in the step's metadata
(`AttentionMetadata.modules`, `attention_modules`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from transformers import AttentionInterface

from worker.model.capability import LayerKV
from worker.model.kernels import kv_int8, native
from worker.model.kernels.params import AttentionParams

ATTN_IMPLEMENTATION = "inflight_paged"


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk in the packed batch: query rows `[q_start, q_end)`.

    `ctx_block_ids` `[ceil(ctx_len / block_size)]` are the blocks holding positions
    `0 … ctx_len - 1` (ctx_len = start_pos + q_len), and `mask` `[q_len, ctx_len]`
    (True = attend) the causal mask over them; both None when the chunk starts at
    position 0 (it then attends to its own fresh K/V).
    """

    q_start: int
    q_end: int
    ctx_block_ids: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows `[row_start, row_end)` (one query token each) sharing one padded context.

    `block_ids` `[rows, max_blocks]` are their block tables cut to the group's longest
    context (padded with block 0); `mask` `[rows, 1, 1, max_blocks * block_size]` is True
    for positions inside each row's context.
    """

    row_start: int
    row_end: int
    block_ids: torch.Tensor
    mask: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once by the model runner.

    Attributes:
        slot_mapping: `[num_tokens]` int64 cache slot of each token of the step.
        num_decodes: the first `num_decodes` tokens are single-token decodes.
        decode_groups: the decodes, split into groups of similar context length.
        prefills: the prefill chunks after the decodes. Both for the reference back end
            (`kernels/torch_ref.py`): read them through `dense()`, which builds them at
            the first call where the runner deferred them (`build_dense`).
        block_tables: `[num_seqs, max_blocks]` int32, padded with 0 (for kernel back ends).
        seq_lens: `[num_seqs]` int32 context length after this step, per sequence.
        query_start_loc: `[num_seqs + 1]` int32 prefix sums of query lengths.
        max_query_len: longest query span of a prefill chunk (1 when only decodes).
        max_seq_len: longest context after this step, over all sequences.
        kv_caches: per layer `(k_cache, v_cache)`, `[num_blocks, block_size, num_kv_heads, head_dim]`
            and `[..., v_head_dim]` (see kernels/torch_ref.py). None only in the load check's
            first pass, which measures each layer's KV shape: attention then returns zeros.
        backend: module with `write_kv` and `paged_attention` (see kernels/torch_ref.py).
        trace: when not None, each attention call records `layer_idx -> what it was asked`
            (the load check compares it with the config; `worker.model.load_check`).
        modules: the model's attention modules by `layer_idx` (`attention_modules`), for
            the op of a compiled forward; None while the forward runs eagerly.
        recurrent: the step's rows and state slots for recurrent mixers
            (`worker.model.recurrent.RecurrentStep`); None: the model has none.
        kv_scales: per layer the key and value scale caches `[num_blocks, block_size,
            num_kv_heads]` of an int8 KV cache (`kernels/kv_int8.py`); None: float caches.
        build_dense: where not None, returns `(decode_groups, prefills)`, built by the
            first `dense()`: a step whose every layer runs a kernel over the block tables
            (the C++ op of a compiled forward on the CPU) never gathers them.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None] | None
    backend: ModuleType
    trace: dict[int, LayerCall] | None = field(default=None)
    modules: dict[int, torch.nn.Module] | None = field(default=None)
    kv_scales: list[tuple[torch.Tensor, torch.Tensor] | None] | None = field(default=None)
    recurrent: Any = field(default=None)  # the recurrent mixers' rows and state slots (`recurrent.RecurrentStep`)
    build_dense: Callable[[], tuple[list[DecodeGroup], list[PrefillSpan]]] | None = field(default=None)

    def dense(self) -> tuple[list[DecodeGroup], list[PrefillSpan]]:
        """`(decode_groups, prefills)`, built now if the runner deferred them."""
        if self.build_dense is not None:
            self.decode_groups, self.prefills = self.build_dense()
            self.build_dense = None
        return self.decode_groups, self.prefills


@dataclass(slots=True, frozen=True)
class LayerCall:
    """What one layer's attention call asked for (recorded by the load check).

    `extra` holds every keyword argument this module does not interpret whose value is
    set (not None / False): a feature of the model our attention would silently ignore.
    """

    params: AttentionParams
    kv: LayerKV
    is_latent: bool
    is_causal: bool
    extra: tuple[str, ...]


# Keyword arguments transformers passes to every attention function that carry nothing
# for us: positions are in the packed batch already, caching is ours, dropout is 0 at
# inference, and the flash-attention varlen arguments describe padding we never have.
_IGNORED_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "return_dict", "past_key_values",
    "past_key_value", "cache", "layer_idx", "dropout", "is_causal", "cu_seq_lens_q", "cu_seq_lens_k",
    "max_length_q", "max_length_k", "position_embeddings", "logits_to_keep", "output_hidden_states",
    "attention_mask", "token_type_ids",
})


_STEP: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar("inflight_step", default=None)


@contextlib.contextmanager
def step_metadata(md: AttentionMetadata) -> Iterator[None]:
    """Make `md` the current step's metadata for the duration of one forward. Attention
    reads it when the model did not pass `inflight_metadata` down (some decoder layers
    drop keyword arguments: Nemotron; BLOOM and Falcon pass none to their attention)."""
    token = _STEP.set(md)
    try:
        yield
    finally:
        _STEP.reset(token)


def current_metadata() -> AttentionMetadata | None:
    return _STEP.get()


def _params(module: torch.nn.Module, scaling: float | None, head_dim: int, kwargs: dict[str, Any]) -> AttentionParams:
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    return AttentionParams(
        scale=float(scaling) if scaling is not None else head_dim ** -0.5,
        sliding_window=int(window) if window else None,
        softcap=float(softcap) if softcap else None,
        sinks=kwargs.get("s_aux"),
        alibi_slopes=getattr(module, "inflight_alibi_slopes", None),
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    inflight_metadata: AttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature.

    Args:
        query: `[1, num_heads, num_tokens, head_dim]`; key, value: `[1, num_kv_heads, num_tokens, head_dim]`
            (positions already applied by the model). For a latent-attention module
            (`worker.model.latent`), key is the latent `[1, 1, num_tokens, kv_lora_rank + rope_dim]`.
        scaling: softmax scale (None: head_dim ** -0.5).
        kwargs: `sliding_window`, `softcap`, `s_aux` (sinks) as the model passes them.

    Returns:
        (`[1, num_tokens, num_heads, v_head_dim]`, None).

    Raises:
        RuntimeError: called without `inflight_metadata` (the model was run outside the engine).
    """
    latent = getattr(module, "inflight_latent", None)
    if traced():  # one opaque op of the compiled graph (worker.model.compiled)
        # `native.LOADED`, not `native_in_graph`: the key computed it before the trace (and a
        # cached function would break the graph)
        native_op = query.device.type == "cpu" and native.LOADED
        op = torch.ops.inflight_native.attention if native_op else torch.ops.inflight.attention
        out = op(
            query, key, value, module.layer_idx, float(scaling) if scaling is not None else query.shape[-1] ** -0.5,
            int(kwargs.get("sliding_window") or 0), float(kwargs.get("softcap") or 0.0), kwargs.get("s_aux"),
            latent.v_dim if latent is not None else value.shape[-1])
        return out, None
    if "inflight_attention" not in module.__dict__:  # found by attention_modules
        module.inflight_attention = True
    md = inflight_metadata if inflight_metadata is not None else _STEP.get()
    if md is None:
        raise RuntimeError(
            f"attention '{ATTN_IMPLEMENTATION}' needs inflight_metadata; run this model through the Inflight engine"
        )
    params = _params(module, scaling, query.shape[-1], kwargs)
    if md.trace is not None:
        extra = tuple(sorted(k for k, v in kwargs.items()
                             if k not in _IGNORED_KWARGS and k not in ("sliding_window", "softcap", "s_aux")
                             and v is not None and v is not False))
        is_causal = kwargs.get("is_causal", getattr(module, "is_causal", True)) is not False
        if latent is not None:
            kv = LayerKV(1, latent.latent_dim, latent.rank, value_in_key=True)
        else:
            kv = LayerKV(key.shape[1], key.shape[-1], value.shape[-1])
        md.trace[module.layer_idx] = LayerCall(params, kv, latent is not None, is_causal, extra)
    if md.kv_caches is None:  # the load check's shape pass
        v_dim = latent.v_dim if latent is not None else value.shape[-1]
        return query.new_zeros(1, query.shape[2], query.shape[1], v_dim), None
    k_cache, v_cache = md.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    k = key[0].transpose(0, 1)
    if latent is not None:
        return latent.attend(q, k, k_cache, v_cache, md, params), None
    v = value[0].transpose(0, 1)
    scales = md.kv_scales[module.layer_idx] if md.kv_scales is not None else None
    if scales is not None:  # an int8 cache (serving_tuning.kv_cache_dtype)
        getattr(md.backend, "write_kv_int8", kv_int8.write_kv)(k, v, k_cache, v_cache, scales, md.slot_mapping)
        out = md.backend.paged_attention(q, k, v, k_cache, v_cache, md, params, scales=scales)
    else:
        md.backend.write_kv(k, v, k_cache, v_cache, md.slot_mapping)
        out = md.backend.paged_attention(q, k, v, k_cache, v_cache, md, params)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


# ---- attention as one opaque op of a compiled forward (worker.model.compiled) --------------
def traced() -> bool:
    """True while the forward is traced rather than run: by Dynamo (`torch.compile`) or
    by a `make_fx` trace (`torch.compiler.precompile`, whose tensors are proxies)."""
    return torch.compiler.is_compiling() or get_proxy_mode() is not None


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The attention modules of `model` that have run our attention (every one, once the
    model made an eager forward: the load check's, a warm-up's), by `layer_idx`.

    Raises:
        ValueError: two modules share a `layer_idx` (the op could not tell them apart).
    """
    found: dict[int, torch.nn.Module] = {}
    for name, m in model.named_modules():
        if m.__dict__.get("inflight_attention"):
            other = found.setdefault(int(m.layer_idx), m)
            if other is not m:
                raise ValueError(f"two attention modules have layer_idx {m.layer_idx} (the second is {name})")
    return found


# Declared with `torch.library.Library` rather than `custom_op`, whose Python wrapper (its
# checks, the output's aliasing among them) cost 7.2 us a call against 4.7 us for the same
# schema and a trivial body (CPU, inference mode), four times a step on the bench model;
# `worker.model.small_batch` and `worker.model.lora` declare theirs so too.
_LIB = torch.library.Library("inflight", "FRAGMENT")
_LIB.define("attention(Tensor query, Tensor key, Tensor value, int layer, float scaling, int sliding_window, "
            "float softcap, Tensor? sinks, int v_head_dim) -> Tensor")


def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
                 sliding_window: int, softcap: float, sinks: torch.Tensor | None, v_head_dim: int) -> torch.Tensor:
    """`torch.ops.inflight.attention`: one attention layer of the step over the paged cache
    (its K/V written first).

    Writing the cache is a side effect on state the step's metadata holds, not on an
    argument (the schema mutates nothing): the op's output feeds the next layer, so a graph never
    drops or reorders it, and the cache is no graph input Dynamo would guard on.

    Args:
        query: `[1, num_heads, num_tokens, head_dim]`; key, value: `[1, num_kv_heads,
            num_tokens, head_dim]` (transformers' layout; latent attention: the latent).
        layer: the attention module's `layer_idx` (the module is the step's `md.modules[layer]`).
        scaling: the softmax scale; sliding_window, softcap: 0 = none; sinks: per head or None.
        v_head_dim: the output's last dimension (what the fake implementation returns).

    Returns:
        `[1, num_tokens, num_heads, v_head_dim]`.

    Raises:
        RuntimeError: no step metadata is current, or it has no module for `layer`.
    """
    md = current_metadata()
    owner = md.modules.get(layer) if md is not None and md.modules is not None else None
    if owner is None:
        raise RuntimeError(f"inflight::attention: no attention module for layer {layer} in the step's metadata")
    out, _ = paged_attention_forward(owner, query, key, value, None, scaling, inflight_metadata=md,
                                     sliding_window=sliding_window or None, softcap=softcap or None, s_aux=sinks)
    # contiguous, as the fake implementation says: Inductor asserts the real output's strides
    # (latent attention's output is an einsum's, strided [t, h, v] -> [1, t, h, v] otherwise)
    return out.contiguous()


_LIB.impl("attention", attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("inflight::attention", lib=_LIB)
def _(query, key, value, layer, scaling, sliding_window, softcap, sinks, v_head_dim):
    return query.new_empty(1, query.shape[2], query.shape[1], v_head_dim)


# ---- the same op in C++ for steps of decodes (kernels/native_ops.cpp) ------------------------
def native_in_graph(device_type: str) -> bool:
    """Whether a forward traced for `device_type` calls `inflight_native::attention` (the
    C++ operators loaded, on the CPU) rather than `inflight::attention`: a captured
    forward's key says which (`worker.model.compiled.artifact_key`)."""
    return device_type == "cpu" and native.available()


@dataclass(frozen=True)
class NativeLayers:
    """A runner's caches as `inflight_native::attention` takes them: per layer its key
    and value caches, or empty tensors where the layer's calls go to the Python op (no
    cache, ALiBi, latent attention; the binding leaves out caches other than fp32 ones on
    the CPU itself); and the decode kernel's address."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    kernel: int


def native_layers(kv_caches: list, kv_scales: list | None, modules: dict[int, torch.nn.Module] | None,
                  backend: ModuleType) -> NativeLayers | None:
    """The layers a runner's compiled forward hands to the C++ op (`NativeLayers`), or
    None where no call would take it: the op not loaded, a back end other than the CPU
    kernels' (`kernels/cpu_attn.py`) or its kernel unbuilt, int8 caches, or no modules
    known (the forward not compiled)."""
    if not native.available() or getattr(backend, "kernel_address", None) is None or kv_scales is not None \
            or modules is None:
        return None
    kernel = backend.kernel_address()
    if kernel is None:
        return None
    empty = torch.empty(0)
    ks, vs = [], []
    for layer, caches in enumerate(kv_caches):
        module = modules.get(layer)
        plain = (caches is not None and module is not None and getattr(module, "inflight_latent", None) is None
                 and getattr(module, "inflight_alibi_slopes", None) is None)
        ks.append(caches[0] if plain else empty)
        vs.append(caches[1] if plain else empty)
    return NativeLayers(ks, vs, kernel)


@contextlib.contextmanager
def native_attention_step(md: AttentionMetadata, layers: NativeLayers | None) -> Iterator[None]:
    """Bind the step `md` for `inflight_native::attention` in this thread for the duration
    of one forward: a step of decodes, and chunks of at most the CPU back end's
    `MAX_CHUNK_ROWS` tokens (a speculating decode's verification, a draft model's
    catch-up), each of whose tokens is a row of the decode kernel reading its context up
    to itself, as that back end computes them (`kernels/cpu_attn.py` `token_rows`; the
    layers were bound for it: `native_layers`). A step with a longer chunk, or the load
    check's trace, binds nothing: its calls go to the Python op (the reference's matrix
    products for long prefills)."""
    bind = (layers is not None and md.trace is None and md.kv_caches is not None
            and md.slot_mapping.device.type == "cpu"
            and (md.num_decodes == md.slot_mapping.shape[0] or md.max_query_len <= md.backend.MAX_CHUNK_ROWS))
    if not bind:
        yield
        return
    tables, seq_lens = (md.block_tables, md.seq_lens) if md.num_decodes == md.slot_mapping.shape[0] \
        else md.backend.token_rows(md.query_start_loc, md.block_tables, md.seq_lens)
    torch.ops.inflight_native.attention_bind(layers.k_caches, layers.v_caches, md.slot_mapping, tables, seq_lens,
                                             torch.get_num_threads(), layers.kernel)
    try:
        yield
    finally:
        torch.ops.inflight_native.attention_unbind()
