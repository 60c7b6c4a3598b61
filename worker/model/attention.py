"""Our paged attention, plugged into transformers models through the
attention-function registry (`AttentionInterface`), the way vLLM's Transformers
back end does it: transformers owns the model definition (projections, RoPE or
learned positions, MLP), we own the KV layout and the packed batch.

The model is called with the whole step as one "sequence" of `num_tokens` tokens
(`input_ids` `[1, num_tokens]`, per-sequence `position_ids`), `use_cache=False`, and
`inflight_metadata=AttentionMetadata(...)`, which transformers forwards to every
attention call. Since the implementation name is not in transformers' mask registry,
no dense mask is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from transformers import AttentionInterface

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
        prefills: the prefill chunks after the decodes.
        block_tables: `[num_seqs, max_blocks]` int32, padded with 0 (for kernel back ends).
        seq_lens: `[num_seqs]` int32 context length after this step, per sequence.
        query_start_loc: `[num_seqs + 1]` int32 prefix sums of query lengths.
        max_query_len: longest query span of a prefill chunk (1 when only decodes).
        max_seq_len: longest context after this step, over all sequences.
        kv_caches: per layer `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads, head_dim]`.
        backend: module with `write_kv` and `paged_attention` (see kernels/torch_ref.py).
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
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: ModuleType


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    inflight_metadata: AttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature.

    Args:
        query: `[1, num_heads, num_tokens, head_dim]`; key, value: `[1, num_kv_heads, num_tokens, head_dim]`
            (positions already applied by the model).

    Returns:
        (`[1, num_tokens, num_heads, head_dim]`, None).

    Raises:
        RuntimeError: called without `inflight_metadata` (the model was run outside the engine).
    """
    md = inflight_metadata
    if md is None:
        raise RuntimeError(
            f"attention '{ATTN_IMPLEMENTATION}' needs inflight_metadata; run this model through the Inflight engine"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit softcapping is not supported by the paged attention back ends")
    k_cache, v_cache = md.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    md.backend.write_kv(k, v, k_cache, v_cache, md.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = md.backend.paged_attention(q, k, v, k_cache, v_cache, md, scale)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
