#!/usr/bin/env bash
# Create .venv and install the project with its dev extras, unless that is already done.
# Sourced by tools/test.sh and tools/demo.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import worker, torch, transformers, hypothesis, tqdm, matplotlib, psutil, aiohttp, pynvml, prometheus_client, structlog, aiokafka" 2>/dev/null; then
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -e ".[dev]"
fi
