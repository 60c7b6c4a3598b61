#!/usr/bin/env bash
# Run the whole test suite (what CI runs). Creates .venv on a fresh clone; extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_venv.sh
exec .venv/bin/python -m pytest -q "$@"
