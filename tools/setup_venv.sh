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
# Bytecode for every installed module, made once: where PYTHONDONTWRITEBYTECODE is set (as
# on the development and CI boxes) Python would otherwise compile torch's and transformers'
# sources again in every process it starts: importing torch, transformers and Inductor
# measured 14.4-15.0 s without, 6.4-7.4 s with (2-core box, loaded); ~40 s to make.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -e "$site/torch/__pycache__/__init__.$(.venv/bin/python -c 'import sys; print(sys.implementation.cache_tag)').pyc" ]; then
  echo "setup_venv: compiling .venv's modules to bytecode (once)" >&2
  # some packages ship sources that are not Python 3 (templates, test data): their errors are not ours
  .venv/bin/python -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
fi
