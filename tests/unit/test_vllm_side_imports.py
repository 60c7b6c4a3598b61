"""With `model.engine: vllm` the engine core runs in vLLM's own interpreter, where only
links to our `worker` and `schemas` packages are on the path (worker/engine/vllm_spec.py):
every module that side imports must need nothing but the standard library and msgspec
(vLLM's environment has no structlog, no redis, none of our other dependencies). The
`exit_now` helper once moved into a module that imports structlog, and no engine with
`engine: vllm` could start; the vLLM suite that would have seen it does not run in CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# imports on the vLLM side: `python -m worker.engine.vllm_core` and the general plugin
# vLLM loads in its own processes (`vllm_spec._package_shim`'s entry point). With LoRA
# adapters `vllm_requests.lora_facts` also imports `worker.model.lora`, which needs torch,
# transformers and huggingface_hub (vLLM's own there): tests/vllm/test_vllm_lora.py runs it.
VLLM_SIDE = ("worker.engine.vllm_core", "worker.engine.vllm_plugin")

PROGRAM = """
import importlib.abc, sys
ALLOWED = set(sys.stdlib_module_names) | {"msgspec", "worker", "schemas"}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in ALLOWED:
            raise ImportError(f"{name} is not in vLLM's environment")
        return None

sys.meta_path.insert(0, Refuse())
for module in sys.argv[1:]:
    __import__(module)
print("imported")
"""


def imports(modules: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_modules_vllms_interpreter_imports_need_only_the_standard_library_and_msgspec():
    out = imports(VLLM_SIDE)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr[-3000:]
    refused = imports(("worker.obs.stopping",))  # the guard refuses what vLLM's environment lacks
    assert refused.returncode != 0 and "structlog is not in vLLM's environment" in refused.stderr
