#!/usr/bin/env bash
# Run uv (https://docs.astral.sh/uv/), installed on first use from PyPI with the
# machine's python3 into .cache/tools/uv-$UV_VERSION (outside .venv, so the project's
# environment holds exactly the lock). Used by tools/setup_venv.sh and tools/lock.sh.
set -euo pipefail
UV_VERSION=0.13.9
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UV_HOME=$ROOT/.cache/tools/uv-$UV_VERSION
if [ ! -x "$UV_HOME/bin/uv" ]; then
  echo "uv: installing uv $UV_VERSION from PyPI into $UV_HOME" >&2
  rm -rf "$UV_HOME.tmp"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
    --target "$UV_HOME.tmp" "uv==$UV_VERSION"
  rm -rf "$UV_HOME" && mv "$UV_HOME.tmp" "$UV_HOME"
fi
exec "$UV_HOME/bin/uv" "$@"
