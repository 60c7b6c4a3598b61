"""The suite's per-test timeout (tests/timeouts.py): a test double whose stop never
returns fails its test within the timeout, with a dump that names the awaiting coroutine,
and the session goes on (in one process and in pytest-xdist workers); a stop that also
swallows its cancellation (so `asyncio.run`'s clean-up hangs too) ends the process after
the grace period, dump written twice."""

from __future__ import annotations

import os
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the inner pytests leave out the plugins the project's runs leave out (pyproject.toml)
ADDOPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]


def ini(timeout_s: int) -> str:
    return f"[pytest]\naddopts = {ADDOPTS}\ntimeout = {timeout_s}\ntimeout_grace_s = 3\n"

STUCK = '''
import asyncio

class StuckGateway:
    """A test double: its stop waits on an event nobody sets."""
    def __init__(self, swallow):
        self.swallow = swallow

    async def stop(self):
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if not self.swallow:
                    raise

async def serve_then_stop(gw):
    await asyncio.sleep(0)
    await gw.stop()

def test_stuck_stop():
    asyncio.run(serve_then_stop(StuckGateway(SWALLOW)))

def test_after_it():
    assert True
'''


def run_inner(pytester, swallow: bool, *args: str):
    pytester.makepyfile(test_inner=STUCK.replace("SWALLOW", str(swallow)))
    pytester.makeini(ini(2))
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    t0 = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "tests.timeouts", "-p", "no:cacheprovider", *args, timeout=120)
    return result, time.monotonic() - t0


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["one-process", "xdist-workers"])
def test_a_stop_that_never_returns_fails_its_test_with_a_dump_naming_the_await(pytester, monkeypatch, xdist):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    result, took = run_inner(pytester, False, *xdist)
    out = result.stdout.str() + result.stderr.str()  # an xdist worker writes its dump to standard error
    result.assert_outcomes(failed=1, passed=1)  # the session went on to the next test
    assert "Timeout: test_inner.py::test_stuck_stop did not end within 2 s" in out
    # the main task's await chain, outermost first, down to the Event's future
    chain = out[out.index("task Task-1 (serve_then_stop)"):]
    assert chain.index("serve_then_stop") < chain.index(" StuckGateway.stop") < chain.index(" Event.wait")
    assert "waits on Future pending" in chain
    assert "thread 'MainThread'" in out and "TestHung: Timeout: the test did not end within 2 s" in out
    assert took < 60


def test_a_stop_that_swallows_its_cancellation_ends_the_process_after_the_grace(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    result, took = run_inner(pytester, swallow=True)
    out = result.stdout.str()
    assert result.ret == 1
    assert "did not end within 2 s" in out
    assert "still had not ended 3 s after its 2 s timeout (its clean-up hangs too); exiting" in out
    assert out.count("StuckGateway.stop") >= 2  # named in both dumps
    assert " passed" not in out  # the process ended: the next test never ran
    assert took < 60


CHILD = '''
import subprocess, sys

def test_waits_on_its_child():
    code = "import time\\ndef child_waits_for_ever():\\n    time.sleep(600)\\nchild_waits_for_ever()"
    subprocess.run([sys.executable, "-c", code], timeout=600)
'''


def test_the_dump_shows_the_stack_of_a_python_child_the_test_waits_on(pytester, monkeypatch):
    """A test hung on a script or worker process: the dump has that process's own stack
    (py-spy, a dev dependency), not only its command line."""
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    pytester.makepyfile(test_inner=CHILD)
    pytester.makeini(ini(4))
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    result = pytester.runpytest_subprocess("-p", "tests.timeouts", "-p", "no:cacheprovider", timeout=120)
    out = result.stdout.str()
    result.assert_outcomes(failed=1)
    child = out[out.index("child processes: 1"):]
    assert "child_waits_for_ever (<string>:3)" in child, child[:3000]  # the child's frame, as py-spy reads it


PAUSED = '''
import time

import pytest

from tests.timeouts import paused


@pytest.fixture(scope="module")
def built():
    with paused():  # a once-per-machine build, longer than the timeout
        time.sleep(3)
    return "built"


def test_after_a_paused_build(built):
    time.sleep(1)  # 1 s of its own: within the 2 s timeout
    assert built == "built"


def test_still_timed(built):
    with paused():
        time.sleep(0.2)
    time.sleep(5)  # the timer resumed after the block: this fails at 2 s
'''


def test_a_paused_build_is_not_the_tests_time_and_the_timer_resumes_after_it(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    pytester.makepyfile(test_inner=PAUSED)
    pytester.makeini(ini(2))
    result = pytester.runpytest_subprocess("-p", "tests.timeouts", "-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(failed=1, passed=1)
    assert "test_inner.py::test_still_timed did not end within 2 s" in result.stdout.str()
