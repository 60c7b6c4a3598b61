#!/usr/bin/env bash
# The demo: starts the dev stack (Kafka + Redis on 127.0.0.1), then runs a worker on a
# locally made model and streams jobs through it. Creates .venv on a fresh clone.
# Extra arguments go to tools/demo.py. Stop the stack with: tools/stack/devstack.sh down
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_venv.sh
tools/stack/devstack.sh up
exec .venv/bin/python -m tools.demo "$@"
