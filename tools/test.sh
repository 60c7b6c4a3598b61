#!/usr/bin/env bash
# Run the whole test suite (what CI runs): creates .venv on a fresh clone, builds the
# docs (`mkdocs build --strict` into .cache/docs-site: a broken link, a missing page or an
# unrenderable docstring fails here, before any service starts), starts the dev stack
# (Redis + Kafka on 127.0.0.1, see tools/stack/devstack.sh) and the secured one beside it
# (`up --secure`: its own ports and state; about 15 s from nothing) for the integration
# tests, starts Jaeger (tools/stack/jaeger.sh: the tracing back end; built from source through
# the Go module proxy the first time on a machine, ~9 min, then cached), installs promtool
# (Debian's prometheus package, the alert-rule tests) and kcat (the tracing tests) when
# missing and running as root, runs pytest (in two phases: every test but the `timing`
# ones in three pytest-xdist workers, then the `timing` tests alone; each lists its
# slowest tests; the seconds of set-up and of pytest at the end), then tools/deploy_check.sh --cached (the
# images and containers, only where they were built before). Extra arguments go to pytest
# (and skip the deploy check). The stacks keep
# running afterwards; stop them with tools/stack/devstack.sh down (and down --secure) and
# tools/stack/jaeger.sh down.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_venv.sh
# The agent checkpoint (tests/conftest.py agent_checkpoint: trained, minutes, cached per
# machine) is made beside the set-up below, and waited for before pytest starts: made
# inside a test, under pytest-xdist, it ran past the test's timeout.
mkdir -p .cache
.venv/bin/python -c "from tests.conftest import agent_checkpoint; print(agent_checkpoint())" \
  >.cache/agent-checkpoint.log 2>&1 &
agent_pid=$!
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir .cache/docs-site
tools/stack/devstack.sh up
tools/stack/devstack.sh up --secure   # TLS / SASL / ACL Kafka and Redis beside it (tests/integration/test_security.py)
tools/stack/jaeger.sh up   # the tracing back end (tests/integration/test_tracing.py); built once per machine
missing=()
command -v promtool >/dev/null || missing+=(prometheus)   # promtool: the alert-rule tests
command -v kcat >/dev/null || missing+=(kcat)              # a non-Python producer: the tracing tests
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "test: installing ${missing[*]} with apt" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! wait "$agent_pid"; then
  tail -n 30 .cache/agent-checkpoint.log >&2
  echo "test: making the agent checkpoint failed (log above)" >&2
  exit 1
fi
setup_s=$SECONDS
if [ $# -gt 0 ]; then
  .venv/bin/python -m pytest -q --durations=25 "$@"
  echo "test: set-up (venv, docs, stacks, Jaeger) $setup_s s, pytest $((SECONDS - setup_s)) s" >&2
else
  # The whole suite in two phases. 1: every test not marked `timing`, in
  # $INFLIGHT_TEST_WORKERS pytest-xdist worker processes (default 3 on any box: the
  # integration tests wait on brokers and worker processes most of their time, so a third
  # worker fills the two cores of the development box); `--dist loadfile` keeps a file's
  # tests in one worker, so its module fixtures (a broker of its own) start once. Files go
  # out in collection order, so the integration files come between the CPU-bound suites
  # (put first, their worker starts all competed at once: slower); a file whose one test
  # holds a core for minutes goes first (tests/conftest.py's LONG_POLES). 2: the
  # tests marked `timing` (they assert TTFT or a share of time), alone in one process.
  # The tiny checkpoints the tests share are made first (a checkpoint written by two
  # workers at once would be torn).
  .venv/bin/python -c "from tests.conftest import TINY, tiny_checkpoint; [tiny_checkpoint(a) for a in TINY]"
  # The checkout's own bytecode, once (as setup_venv does for .venv): with
  # PYTHONDONTWRITEBYTECODE set, every worker process and CLI run the tests start compiled
  # the modules it imports again (~2 s here; Python checks each source's mtime).
  .venv/bin/python -m compileall -q -j 0 worker schemas tools tests >/dev/null
  rc=0
  .venv/bin/python -m pytest -q --durations=25 -n "${INFLIGHT_TEST_WORKERS:-3}" --dist loadfile -m "not timing" \
    || rc=$?
  parallel_s=$((SECONDS - setup_s))
  echo "===== pytest: timing (alone) ====="
  # The timing tests assert figures of time: say what else holds the CPU as they start
  # (over 2 s: the CPU line, whose `st` is the host's steal, and processes at 5% of a core
  # or more; a process a test left running shows here).
  echo "test: the CPU before the timing tests (top, 2 s):" >&2
  top -b -c -n 2 -d 2 -w 200 | awk '/^top -/{n++} n==2 && (/^%Cpu/ || (/^ *[0-9]/ && $9+0 >= 5))' | head -9 >&2 \
    || true
  # Only the files that hold `timing` tests are collected (collecting all of them took
  # ~25 CPU-s, longer than some of the tests): tests/repo/test_suite_phases.py checks that every
  # test marked `timing` is in a file this grep finds.
  mapfile -t timing_files < <(grep -rl --include='test_*.py' 'pytest.mark.timing' tests | sort)
  timing_rc=0
  .venv/bin/python -m pytest -q --durations=10 -m timing "${timing_files[@]}" || timing_rc=$?
  echo "test: set-up (venv, docs, stacks, Jaeger) $setup_s s, pytest $((SECONDS - setup_s)) s" \
    "(in workers $parallel_s s, timing tests $((SECONDS - setup_s - parallel_s)) s)" >&2
  [ "$rc" = 0 ] || { echo "test: the tests failed (exit $rc)" >&2; exit "$rc"; }
  [ "$timing_rc" = 0 ] || { echo "test: the timing tests failed (exit $timing_rc)" >&2; exit "$timing_rc"; }
fi
# The whole suite also runs the deployment in containers (tests/deploy, podman + runc)
# when this machine has built its images before (2-4 min); from nothing it takes 6-14 min,
# so then it says so and leaves it to `tools/deploy_check.sh` by hand.
if [ $# -eq 0 ]; then
  tools/deploy_check.sh --cached
fi
