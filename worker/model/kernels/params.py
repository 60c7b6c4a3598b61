"""Per-layer attention options beyond the causal softmax: the part of the back-end
contract that varies by layer (the step's batch layout is `AttentionMetadata`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, frozen=True)
class AttentionParams:
    """What one layer's attention call asks for, in transformers' terms.

    Attributes:
        scale: factor on q·k before everything else (usually head_dim ** -0.5).
        sliding_window: W: the query at position p attends to keys at positions
            `(p - W, p]`, i.e. the last W tokens including itself (transformers'
            `sliding_window_overlay`; Mistral, Gemma 2/3, GPT-OSS, Cohere 2 …). None: the
            whole causal context.
        softcap: the logits become `softcap * tanh(logits / softcap)` before masking
            (Gemma 2's `attn_logit_softcapping`).
        sinks: `[num_heads]` learned logit of a virtual key whose value is zero, so a
            head may put weight on nothing (GPT-OSS's `sinks`; Xiao et al., "Efficient
            Streaming Language Models with Attention Sinks", ICLR 2024).
        alibi_slopes: `[num_heads]`; the logit of a key at absolute position j gains
            `slope * j` (ALiBi, Press et al., ICLR 2022; BLOOM). Softmax is shift-invariant
            per query, so this equals the relative form `slope * (j - i)`.
    """

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None

    @property
    def changes_logits(self) -> bool:
        """Soft-capping, sinks or ALiBi: more than a mask on the scaled logits."""
        return self.softcap is not None or self.sinks is not None or self.alibi_slopes is not None
