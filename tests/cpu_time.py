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
pytest-xdist.
"""

from __future__ import annotations

import resource

import pytest

TOP = 15
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
    rows = []
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) == "teardown":
                rows += [(v, r.nodeid) for k, v in getattr(r, "user_properties", ()) if k == "cpu_s"]
    if not rows:
        return
    rows.sort(reverse=True)
    total = sum(v for v, _ in rows)
    terminalreporter.section(f"most CPU (of {total:.0f} CPU-s in {len(rows)} tests, tests/cpu_time.py)", sep="=")
    for v, nodeid in rows[:TOP]:
        terminalreporter.line(f"{v:8.1f} CPU-s  {100 * v / total:4.1f}%  {nodeid}")
