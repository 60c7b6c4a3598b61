"""Model coverage is a correctness property: every architecture is either reproduced
exactly by the engine or refused at load with one line naming the feature and the
config field — never wrong tokens, never a per-request error for a property of the model.

Each family of tools.tiny_archs (the 30 of the model-coverage issue: sliding windows of
16 tokens on alternating layers, soft-capping, sinks, latent attention, ALiBi, Falcon's
own attention, Mamba and linear-attention hybrids), and the recurrent-state families
(`STATE_FAMILIES`: pure Mamba / Mamba-2, the Mamba-2 hybrids, short convolutions), runs
four greedy requests that join a running batch at different steps, with 16-token chunked
prefill and contexts up to 9x the window, against transformers' `generate` for each
request alone.
"""

from __future__ import annotations

import pytest

from tests.conftest import arch_checkpoint
from tools.tiny_archs import FAMILIES, NAMED_FAMILIES, REFUSED, STATE_FAMILIES, verdict


@pytest.mark.parametrize("family", list(NAMED_FAMILIES))
def test_family_is_exact_or_refused_at_load(family):
    result = verdict(arch_checkpoint(family), max_tokens=24)
    if family in REFUSED:
        assert result["result"] == "refused", result
        why = result["why"]
        assert REFUSED[family] in why and "config." in why and "not supported" in why, why
        assert "\n" not in why
    else:
        assert result == {"result": "exact"}, result


def test_only_the_refusal_example_is_refused():
    """Qwen3-Next and Jamba were refused for their recurrent state until the engine kept it."""
    assert len(FAMILIES) == 30 and len(STATE_FAMILIES) == 13 and set(REFUSED) == {"DeepSeek-V3.2"}
