"""The suite's per-test timeout: pytest-timeout's settings (`timeout` in pyproject.toml,
`@pytest.mark.timeout(N)` where a test needs longer, `--timeout` / `PYTEST_TIMEOUT`),
with a timer of our own (pytest-timeout's `pytest_timeout_set_timer` hook) that says what
a hung test waited on before it fails it.

When a test runs past its timeout, SIGALRM on the main thread:

  1. writes a dump to the terminal (so into the CI log, past pytest's capture; from a
     pytest-xdist worker, to its standard error, which is the controller's): every
     asyncio task of the running event loop with its await chain down to the await that
     never returned (`worker.obs.stacks.task_stacks`), every thread's stack, and the child
     processes still alive;
  2. raises `TestHung` there. It derives from SystemExit, the one exception (with
     KeyboardInterrupt, which would end the whole session) that asyncio lets out of a
     task step or a callback instead of storing it, so it stops `asyncio.run` wherever
     the loop was; pytest reports it as the test's failure;
  3. arms a last resort: cleaning up after the failure can hang too (`asyncio.run`
     cancels every task and waits for them: a task that swallows its cancellation, or a
     thread of the default executor that never returns, waits for ever). If the test
     has not ended `timeout_grace_s` seconds later (ini, default 60), the dump is written again and the process
     exits with status 1, as pytest-timeout's `thread` method does.

With `timeout_method = thread`, or off the main thread, pytest-timeout's own timer runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback

import pytest

GRACE_S = 60.0  # the ini option timeout_grace_s sets another


def pytest_addoption(parser):
    parser.addini("timeout_grace_s", f"seconds a timed-out test may take to clean up before the process exits "
                                     f"(default {GRACE_S:g})", default=str(GRACE_S))


class TestHung(SystemExit):
    """A test ran past its timeout (raised on the main thread by SIGALRM)."""

    __test__ = False  # not a test class, whatever its name


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None  # pytest-timeout's own timer
    last_resort: list[threading.Timer] = []
    grace_s = float(item.config.getini("timeout_grace_s"))

    def on_alarm(signum, frame):
        write_dump(item, f"{item.nodeid} did not end within {settings.timeout:g} s")
        timer = threading.Timer(grace_s, give_up, (item, settings.timeout, grace_s))
        timer.daemon = True
        timer.start()
        last_resort.append(timer)
        raise TestHung(f"Timeout: the test did not end within {settings.timeout:g} s; the dump above "
                       f"names what it waited on (asyncio tasks innermost last, threads, child processes)")

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        for timer in last_resort:
            timer.cancel()

    item.cancel_timeout = cancel  # called by pytest-timeout's pytest_timeout_cancel_timer
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True


@contextlib.contextmanager
def paused():
    """The running test's timer stops inside the block and resumes after it with the
    seconds it had left: for a fixture that builds a cached artifact once per machine
    (minutes: tests/conftest.py agent_checkpoint), which is not the test's own time.
    Only our SIGALRM timer pauses (the main thread, `timeout_method = signal`); elsewhere
    nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield
    finally:
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, left)


def give_up(item, timeout: float, grace_s: float) -> None:
    write_dump(item, f"{item.nodeid} still had not ended {grace_s:g} s after its {timeout:g} s timeout "
                     f"(its clean-up hangs too); exiting")
    sys.stderr.flush()
    os._exit(1)


def write_dump(item, title: str) -> None:
    """The dump of steps 1 and 3, written to pytest's terminal (not captured). In a
    pytest-xdist worker, whose terminal goes nowhere, to the standard error it inherited
    from the controller (so into the same CI log)."""
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # straight to the terminal, whatever becomes of the test's report
        capture.suspend_global_capture(in_=True)
    rule = "+" * 20
    lines = [f"{rule} Timeout: {title} {rule}", *dump_lines(), f"{rule} end of the timeout dump {rule}"]
    workerinput = getattr(item.config, "workerinput", None)  # set in an xdist worker only (not inherited)
    if workerinput is not None:
        worker = workerinput.get("workerid", "xdist")
        os.write(2, "".join(f"[{worker}] {line}\n" for line in ["", *lines]).encode(errors="replace"))
    else:
        terminal = item.config.get_terminal_writer()
        terminal.line()
        for line in lines:
            terminal.line(line)
        terminal.flush()
    if capture is not None:
        capture.resume_global_capture()


def dump_lines() -> list[str]:
    """Every asyncio task of every loop that runs in this process, every thread's stack,
    the children still alive (lines of text)."""
    from worker.obs.stacks import task_stacks

    lines: list[str] = []
    for loop, thread_name in running_loops():
        try:
            stacks = task_stacks(loop)
        except Exception as e:  # the task set changed under us (another thread's loop)
            lines.append(f"asyncio tasks of the loop in {thread_name}: unreadable ({e!r})")
            continue
        lines.append(f"asyncio tasks of the loop in thread {thread_name!r}: {len(stacks)}, each await chain "
                     f"outermost first, the await that has not returned last")
        for name, frames in sorted(stacks.items()):
            lines.append(f"  task {name}")
            lines += [f"      {f}" for f in frames]
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    lines.append(f"threads: {len(frames)}")
    for ident, frame in frames.items():
        lines.append(f"  thread {names.get(ident, ident)!r}")
        lines += ["    " + ln for entry in traceback.format_stack(frame) for ln in entry.rstrip().splitlines()]
    lines += children_lines()
    return lines


def running_loops() -> list[tuple[object, str]]:
    """(loop, thread name) for each event loop running now: the main thread's (we run on
    it, in a signal handler) and any other thread's found in its frames."""
    import asyncio

    found = []
    main = asyncio._get_running_loop() if threading.current_thread() is threading.main_thread() else None
    if main is not None:
        found.append((main, "MainThread"))
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        f = frame
        while f is not None:
            loop = f.f_locals.get("self")
            if isinstance(loop, asyncio.AbstractEventLoop) and f.f_code.co_name == "run_forever":
                if all(loop is not seen for seen, _ in found):
                    found.append((loop, names.get(ident, str(ident))))
                break
            f = f.f_back
    return found


PY_SPY_S = 20.0  # at most this long for the stacks of all child processes, seconds


def children_lines() -> list[str]:
    """The child processes still alive; for each Python one, every thread's stack from
    `py-spy dump` (a dev dependency; where it is missing or cannot attach, the line
    says so) — a worker process or a script the test waits on, seen from outside."""
    try:
        import psutil
    except ImportError:
        return []
    lines, num = [], 0
    deadline = time.monotonic() + PY_SPY_S
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = child.cmdline()
            lines.append(f"child process {child.pid} ({child.status()}, up {time.time() - child.create_time():.0f} s): "
                         f"{' '.join(cmd)[:300]!r}")
        except psutil.Error:
            continue
        num += 1
        if cmd and "python" in os.path.basename(cmd[0]):
            lines += ["  " + ln for ln in py_spy_dump(child.pid, deadline - time.monotonic())]
    return [f"child processes: {num}", *("  " + ln for ln in lines)]


def py_spy_dump(pid: int, timeout_s: float) -> list[str]:
    """`py-spy dump --pid PID` (the Python stack of each of its threads) as lines, or one line saying why not."""
    import shutil
    import subprocess

    exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if exe is None:
        return ["(no py-spy to read its stacks)"]
    if timeout_s <= 0:
        return ["(stacks not read: the dump's time for them is spent)"]
    try:
        proc = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [f"(py-spy dump did not end within {timeout_s:.0f} s)"]
    out = (proc.stdout if proc.returncode == 0 else f"(py-spy dump failed: {proc.stderr.strip()[:300]})")
    return out.rstrip().splitlines()[:200]
