#!/usr/bin/env bash
# Make .venv hold exactly requirements.lock plus this project (editable). Sourced by
# tools/test.sh (so CI) and tools/demo.sh; tools/stack/devstack.sh runs it too.
#
# Every run compares the installed versions with the lock (tools/lockcheck.py, well
# under a second, installs nothing); on any difference (a fresh clone, a refreshed lock,
# a package added or changed by hand) it syncs .venv to the lock with uv (tools/uv.sh
# installs uv from PyPI on first use): missing packages installed, wrong versions
# replaced, packages the lock does not list removed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python tools/lockcheck.py --quiet requirements.lock; then
  echo "setup_venv: installing requirements.lock into .venv" >&2
  tools/uv.sh pip sync --quiet --python .venv/bin/python requirements.lock
  tools/uv.sh pip install --quiet --python .venv/bin/python --no-deps --build-constraints requirements.lock -e .
  .venv/bin/python tools/lockcheck.py requirements.lock
fi
