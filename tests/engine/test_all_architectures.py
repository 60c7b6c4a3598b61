"""Every causal-LM architecture transformers ships (the installed version's
`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`) that can be built small is either exact or refused
at load — none gives wrong tokens, none fails per request. An architecture whose config
does not shrink (nested vision or audio towers, hundreds of millions of parameters with
the common size fields) or on which transformers' own `generate` fails is skipped, with
the reason (pytest -rs lists them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tests.conftest import MODEL_CACHE, tiny_checkpoint
from tools.tiny_archs import make_tiny, verdict

ARCHS = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ARCHS)
def test_exact_or_refused(model_type):
    out = Path(MODEL_CACHE) / "all-archs-v1" / model_type
    if not (out / "config.json").is_file():
        try:
            make_tiny(model_type, out, tiny_checkpoint("llama"))
        except Exception as e:  # the config class cannot be built small here: nothing to judge
            pytest.skip(f"not built small: {type(e).__name__}: {str(e)[:120]}")
    result = verdict(out, max_tokens=12)
    if result["result"] == "not built":
        pytest.skip(result["why"])
    assert result["result"] in ("exact", "refused"), result
    if result["result"] == "refused":
        assert result["why"].startswith("model '") and "; not supported" in result["why"]
