#!/usr/bin/env bash
# Run the whole test suite (what CI runs): creates .venv on a fresh clone, builds the
# docs (`mkdocs build --strict` into .cache/docs-site: a broken link, a missing page or an
# unrenderable docstring fails here, before any service starts), starts the dev stack
# (Redis + Kafka on 127.0.0.1, see tools/devstack.sh) and the secured one beside it
# (`up --secure`: its own ports and state; about 15 s from nothing) for the integration
# tests, starts Jaeger (tools/jaeger.sh: the tracing back end; built from source through
# the Go module proxy the first time on a machine, ~9 min, then cached), installs promtool
# (Debian's prometheus package, the alert-rule tests) and kcat (the tracing tests) when
# missing and running as root, runs pytest (in two phases: the suites without services
# beside the integration suite, then the `timing` tests alone; each lists its slowest
# tests; the seconds of set-up and of pytest at the end), then tools/deploy_check.sh --cached (the
# images and containers, only where they were built before). Extra arguments go to pytest
# (and skip the deploy check). The stacks keep
# running afterwards; stop them with tools/devstack.sh down (and down --secure) and
# tools/jaeger.sh down.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_venv.sh
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir .cache/docs-site
tools/devstack.sh up
tools/devstack.sh up --secure   # TLS / SASL / ACL Kafka and Redis beside it (tests/integration/test_security.py)
tools/jaeger.sh up   # the tracing back end (tests/integration/test_tracing.py); built once per machine
missing=()
command -v promtool >/dev/null || missing+=(prometheus)   # promtool: the alert-rule tests
command -v kcat >/dev/null || missing+=(kcat)              # a non-Python producer: the tracing tests
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "test: installing ${missing[*]} with apt" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
setup_s=$SECONDS
if [ $# -gt 0 ]; then
  .venv/bin/python -m pytest -q --durations=25 "$@"
  echo "test: set-up (venv, docs, stacks, Jaeger) $setup_s s, pytest $((SECONDS - setup_s)) s" >&2
else
  # The whole suite in two phases. 1: the suites without services (unit, repo, engine,
  # kernels) and the integration suite side by side, in two pytest processes (the
  # integration tests wait on brokers and worker processes much of their time); each
  # one's report is printed when both are done. 2: the tests marked `timing` (they assert
  # TTFT or a share of time), alone. The tiny checkpoints both need are made first (a
  # checkpoint written by two processes at once would be torn).
  .venv/bin/python -c "from tests.conftest import TINY, tiny_checkpoint; [tiny_checkpoint(a) for a in TINY]"
  mkdir -p .cache/test-logs .cache/test-tmp  # pytest makes each --basetemp, not its parent
  pytest_phase() {  # name, pytest arguments: report to .cache/test-logs/<name>.log, status to <name>.rc
    local name=$1; shift
    set +e
    .venv/bin/python -m pytest -q --durations=15 --basetemp ".cache/test-tmp/$name" "$@" \
      > ".cache/test-logs/$name.log" 2>&1
    echo $? > ".cache/test-logs/$name.rc"
    set -e
  }
  pytest_phase services-free -m "not integration and not timing" &
  pytest_phase integration -m "integration and not timing" tests/integration &
  wait
  for name in services-free integration; do
    echo "===== pytest: $name =====" && cat ".cache/test-logs/$name.log"
  done
  parallel_s=$((SECONDS - setup_s))
  echo "===== pytest: timing (alone) ====="
  timing_rc=0
  .venv/bin/python -m pytest -q --durations=10 -m timing || timing_rc=$?
  echo "test: set-up (venv, docs, stacks, Jaeger) $setup_s s, pytest $((SECONDS - setup_s)) s" \
    "(side by side $parallel_s s, timing tests $((SECONDS - setup_s - parallel_s)) s)" >&2
  for name in services-free integration; do
    rc=$(cat ".cache/test-logs/$name.rc")
    [ "$rc" = 0 ] || [ "$rc" = 5 ] || { echo "test: the $name tests failed (exit $rc)" >&2; exit "$rc"; }
  done
  [ "$timing_rc" = 0 ] || { echo "test: the timing tests failed (exit $timing_rc)" >&2; exit "$timing_rc"; }
fi
# The whole suite also runs the deployment in containers (tests/deploy, podman + runc)
# when this machine has built its images before (2-4 min); from nothing it takes 6-14 min,
# so then it says so and leaves it to `tools/deploy_check.sh` by hand.
if [ $# -eq 0 ]; then
  tools/deploy_check.sh --cached
fi
