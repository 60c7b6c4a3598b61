"""Each test's CPU seconds, listed at the end of the run beside pytest's wall-clock
`--durations`: on the 2-core box the suite is bound by CPU, not by waiting, so the tests
to make cheaper are the ones that burn the most CPU, not the ones that take the longest.

A test's figure is user + system seconds of the pytest process (its setup, call and
teardown) plus those of the child processes it reaped in that time (worker processes,
`subprocess.run`; a module-scoped fixture's broker counts in the test whose teardown
stops it). Processes started outside the test (the dev stack's Kafka and Redis, the
other xdist workers) are not counted. CPU time spent waiting counts too: torch's OpenMP
threads spin while they wait for a core, which is why tests/conftest.py gives each xdist
worker one torch thread. The figures travel in each teardown report's
`user_properties` as ("cpu_s", seconds), so they reach the controller under
pytest-xdist. The summary also gives each suite's total (tests/unit, tests/engine, ...)
and writes every test's figures to `.cache/test-cpu.json` (`test-cpu-timing.json` for a
`-m timing` run, so the suite's second phase keeps the first one's; nodeid, CPU-s, wall s of
setup + call + teardown), to find where a run's CPU went.
"""

from __future__ import annotations

import json
import resource
from collections import defaultdict
from pathlib import Path

import pytest

TOP = 15
OUT = Path(__file__).resolve().parents[1] / ".cache" / "test-cpu.json"
_started: dict[str, float] = {}


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _started[item.nodeid] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and item.nodeid in _started:
        report.user_properties.append(("cpu_s", _cpu_s() - _started.pop(item.nodeid)))


def pytest_terminal_summary(terminalreporter):
    rows, wall = [], defaultdict(float)
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call", "teardown"):
                wall[r.nodeid] += getattr(r, "duration", 0.0)
            if getattr(r, "when", None) == "teardown":
                rows += [(v, r.nodeid) for k, v in getattr(r, "user_properties", ()) if k == "cpu_s"]
    if not rows:
        return
    rows.sort(reverse=True)
    total = sum(v for v, _ in rows)
    terminalreporter.section(f"most CPU (of {total:.0f} CPU-s in {len(rows)} tests, tests/cpu_time.py)", sep="=")
    for v, nodeid in rows[:TOP]:
        terminalreporter.line(f"{v:8.1f} CPU-s  {100 * v / total:4.1f}%  {nodeid}")
    suites = defaultdict(float)
    for v, nodeid in rows:
        suites["/".join(nodeid.split("/")[:2])] += v
    terminalreporter.line("by suite: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(suites.items(), key=lambda kv: -kv[1])))
    out = OUT.with_name("test-cpu-timing.json") if terminalreporter.config.option.markexpr == "timing" else OUT
    try:
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps([{"test": n, "cpu_s": round(v, 2), "wall_s": round(wall[n], 2)} for v, n in rows],
                                  indent=0))
    except OSError as e:  # a read-only checkout: the summary above is still printed
        terminalreporter.line(f"could not write {out}: {e}")
