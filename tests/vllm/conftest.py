"""The `vllm` suite: Inflight's worker on vLLM's engine (`model.engine: vllm`,
worker/engine/vllm_core.py), against vLLM's CPU build in its own interpreter
(`tools/setup_vllm.sh` makes `.cache/vllm-venv`; `INFLIGHT_VLLM_PYTHON` names another).
Every test here is marked `vllm` and skips, saying how to run it, when that interpreter
is absent (CI's fresh clone: the install is ~6 GB):

    tools/setup_vllm.sh && .venv/bin/python -m pytest -m vllm
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.conftest import prefix, services  # noqa: F401 (the worker tests' Kafka and Redis)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("INFLIGHT_VLLM_PYTHON", ROOT / ".cache" / "vllm-venv" / "bin" / "python"))


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.vllm)
            if "services" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.integration)
            if not VLLM_PYTHON.is_file():
                item.add_marker(pytest.mark.skip(reason=f"no vLLM interpreter at {VLLM_PYTHON}: "
                                                        "tools/setup_vllm.sh makes it"))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return str(VLLM_PYTHON)


@pytest.fixture(scope="session")
def vllm_llama_path() -> Path:
    """A tiny Llama whose heads vLLM's CPU attention takes (head_dim 64; the suite's
    other tiny models have 16, which it refuses), made once under .cache/test-models."""
    from tests.conftest import MODEL_CACHE
    from tools.make_model import make_checkpoint

    out = MODEL_CACHE / "tiny-llama-hd64-v1"
    if not (out / "model.safetensors").is_file():
        make_checkpoint(out, arch="llama", vocab_size=512, hidden=128, layers=2, heads=2, kv_heads=1, max_len=1024,
                        corpus_chars=400_000, log=lambda *_: None)
    return out
