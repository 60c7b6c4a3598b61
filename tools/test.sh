#!/usr/bin/env bash
# Run the whole test suite. Creates .venv and installs the project (with dev extras)
# on a fresh clone; later runs reuse it. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import worker, torch, transformers, hypothesis" 2>/dev/null; then
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -e ".[dev]"
fi
exec .venv/bin/python -m pytest -q "$@"
