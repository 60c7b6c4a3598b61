#!/usr/bin/env bash
# Refresh requirements.lock, the pinned set that tools/setup_venv.sh (so tools/test.sh,
# CI and the demo) and deploy/Dockerfile install. Resolved by `uv pip compile` from the
# ranges in pyproject.toml with the dev extra (worker + tools + test deps), for every
# platform and Python >= 3.11 at once (--universal: markers keep e.g. the CUDA wheels
# on Linux only), so the same file serves this 3.11 box and the 3.12 GPU image.
#
#   tools/lock.sh                          re-resolve, keeping every pin that still fits
#   tools/lock.sh --upgrade                newest versions the ranges allow
#   tools/lock.sh --upgrade-package torch  move one package (repeatable)
#
# Then run tools/setup_venv.sh (it syncs .venv to the new lock) and tools/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
exec tools/uv.sh pip compile pyproject.toml --extra dev --universal --python-version 3.11 \
  --output-file requirements.lock --custom-compile-command "tools/lock.sh" --quiet "$@"
