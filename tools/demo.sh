#!/usr/bin/env bash
# Run the demo. Creates .venv on a fresh clone; extra arguments go to tools/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_venv.sh
exec .venv/bin/python -m tools.demo "$@"
