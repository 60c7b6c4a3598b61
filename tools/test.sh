#!/usr/bin/env bash
# Run the whole test suite (what CI runs): creates .venv on a fresh clone, starts the
# dev stack (Redis + Kafka on 127.0.0.1, see tools/devstack.sh) for the integration
# tests, runs pytest. Extra arguments go to pytest. The stack keeps running afterwards;
# stop it with tools/devstack.sh down.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_venv.sh
tools/devstack.sh up
exec .venv/bin/python -m pytest -q "$@"
