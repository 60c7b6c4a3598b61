"""Bounded stops (worker/obs/stopping.py): a stop step that returns, fails, hangs, or
swallows its cancellation ends within its bound; the gateway's stop, the worker's close,
the client's close and `stop_client` end in bounded time with a planted component that
never stops; and no `asyncio.wait_for` is left in the tree (its Python 3.11 behaviour is
the rule this replaces)."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import pytest
import structlog

from worker.obs import stopping
from worker.obs.stopping import start_unless_stopped, stop_within

ROOT = Path(__file__).resolve().parents[2]


RELEASED = asyncio.Event()  # set by `timed` after the test's coroutine: stubborn waits give up


async def forever(swallow: bool) -> None:
    """Waits for ever; with `swallow`, ignores every cancellation until `RELEASED`."""
    while True:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if not swallow or RELEASED.is_set():
                raise


async def stuck_close(*_args, **_kw) -> None:
    """A close that never returns and swallows every cancellation (the worst case)."""
    await forever(swallow=True)


def timed(coro):
    """(result, seconds) of running `coro`; then what it left behind is let go, so that
    `asyncio.run` (which cancels and awaits every task) can end."""
    async def main():
        RELEASED.clear()
        t0 = time.monotonic()
        try:
            return await coro, time.monotonic() - t0
        finally:
            RELEASED.set()
    return asyncio.run(main())


def test_a_step_that_returns_is_awaited():
    async def ok():
        await asyncio.sleep(0.01)
        return 1

    assert timed(stop_within("ok", ok(), 5))[0] is True


def test_a_failing_step_is_logged_and_the_stop_goes_on():
    async def fails():
        raise ConnectionError("broker gone")

    with structlog.testing.capture_logs() as logs:
        out, took = timed(stop_within("client close", fails(), 5))
    assert out is False and took < 1
    assert logs[-1]["event"] == "stop step failed; stopping anyway" and logs[-1]["step"] == "client close"
    assert "ConnectionError: broker gone" in logs[-1]["error"]


def test_a_hanging_step_is_cancelled_at_its_bound():
    with structlog.testing.capture_logs() as logs:
        out, took = timed(stop_within("hangs", forever(swallow=False), 0.3))
    assert out is False and 0.3 <= took < 1.0
    assert logs[-1]["event"] == "stop step did not end within its bound; cancelled"


def test_a_step_that_swallows_its_cancellation_is_left_behind_and_named():
    with structlog.testing.capture_logs() as logs:
        out, took = timed(stop_within("swallows", forever(swallow=True), 0.3))
    assert out is False and 0.3 + stopping.CANCEL_GRACE_S <= took < 0.3 + stopping.CANCEL_GRACE_S + 1.0
    line = logs[-1]
    assert line["event"] == "stop step did not end within its bound; left behind" and line["step"] == "swallows"
    assert "forever" in line["waiting_in"]  # the coroutine it waits in is named


def test_the_callers_cancellation_propagates_and_cancels_the_step():
    async def main():
        step = asyncio.ensure_future(forever(swallow=False))
        outer = asyncio.ensure_future(stop_within("step", step, 30))
        await asyncio.sleep(0.05)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await asyncio.sleep(0)
        return step.cancelled()

    assert asyncio.run(main()) is True


def test_stop_client_closes_the_connections_of_a_client_whose_stop_never_returns():
    class Inner:
        closed = False

        async def close(self):
            Inner.closed = True

    class Client:
        _client = Inner()
        stop = staticmethod(stuck_close)

    from worker.security.kafka import stop_client

    _, took = timed(stop_client(Client(), "intake", timeout_s=0.3))
    assert Inner.closed and took < 0.3 + stopping.CANCEL_GRACE_S + 1.0


def test_the_gateway_stops_in_bounded_time_with_components_that_never_stop(monkeypatch, tmp_path):
    """Planted: an HTTP runner, a readiness task, a batch driver and a client whose stops
    never return and swallow their cancellations."""
    monkeypatch.setattr(stopping, "CANCEL_GRACE_S", 0.1)
    from tests.integration.gateway_helpers import gateway_config
    from worker.gateway.app import Gateway
    from worker.gateway.batch import manager

    monkeypatch.setattr(manager, "DRIVER_STOP_S", 0.3)
    cfg = gateway_config(("127.0.0.1:1", "redis://127.0.0.1:1/0"), "p", tmp_path, drain_timeout_s=0.1)

    class Stuck:
        cleanup = close = staticmethod(stuck_close)

    class Cancels:
        async def drain(self):
            return None

    async def main():
        gw = Gateway(cfg)
        gw._runner = Stuck()
        gw._tasks = [asyncio.ensure_future(forever(swallow=True))]
        gw.batches = manager.BatchManager.__new__(manager.BatchManager)
        gw.batches._drivers = {"b": asyncio.ensure_future(forever(swallow=True))}
        gw.ctx = type("Ctx", (), {"cancels": Cancels()})()
        gw.client = Stuck()
        monkeypatch.setattr("worker.gateway.app.stop_within", _scaled(stop_within, 0.02))
        with structlog.testing.capture_logs() as logs:
            await gw.stop()
        return [line["step"] for line in logs if line["event"].startswith("stop step")]

    steps, took = timed(main())
    assert steps == ["gateway: HTTP server", "gateway: batch scan and readiness checks", "gateway: 1 batch driver(s)",
                     "gateway: Kafka and Redis clients"]
    assert took < 5


def test_the_worker_closes_in_bounded_time_with_components_that_never_stop(monkeypatch):
    monkeypatch.setattr(stopping, "CANCEL_GRACE_S", 0.1)
    from tests.integration.conftest import worker_config
    from worker.serve import worker as worker_module
    from worker.serve.worker import Worker

    cfg = worker_config(("127.0.0.1:1", "redis://127.0.0.1:1/0"), "p", metrics={"port": None})

    class Stuck:
        commit = aclose = close = staticmethod(stuck_close)
        consumer = None

    async def main():
        monkeypatch.setattr(worker_module, "stop_within", _scaled(stop_within, 0.02))
        w = Worker(cfg)
        w.intake = Stuck()
        w.redis = Stuck()
        with structlog.testing.capture_logs() as logs:
            await w.close()
        return [line["step"] for line in logs if line["event"].startswith("stop step")]

    steps, took = timed(main())
    assert steps == ["worker: final offset commit", "worker: Redis connections"]
    assert took < 5


def test_a_start_that_completes_or_fails_before_a_stop_is_reported_as_such():
    async def ok():
        return None

    async def fails():
        raise ConnectionError("no broker")

    assert timed(start_unless_stopped(ok(), asyncio.Event(), "worker"))[0] is True
    with pytest.raises(ConnectionError, match="no broker"):
        timed(start_unless_stopped(fails(), asyncio.Event(), "worker"))


@pytest.mark.parametrize("swallow", [False, True], ids=["unwinds", "swallows-its-cancellation"])
def test_a_stop_during_the_start_cancels_the_start(monkeypatch, swallow):
    monkeypatch.setattr(stopping, "START_UNWIND_S", 0.3)
    monkeypatch.setattr(stopping, "CANCEL_GRACE_S", 0.1)

    async def main():
        stop = asyncio.Event()
        start = asyncio.ensure_future(forever(swallow=swallow))
        asyncio.get_running_loop().call_later(0.1, stop.set)
        with structlog.testing.capture_logs() as logs:
            started = await start_unless_stopped(start, stop, "worker")
        return started, start.done(), [line["event"] for line in logs]

    (started, start_done, events), took = timed(main())
    assert started is False and start_done is not swallow  # a start that will not unwind is left behind
    assert events[0] == "stop requested during start; cancelling the start"
    assert took < 0.1 + 0.3 + 0.1 + 1.0
    if swallow:
        assert events[-1] == "stop step did not end within its bound; left behind"


@pytest.mark.parametrize("component", ["worker", "gateway"])
def test_sigterm_during_a_start_that_never_ends_stops_the_process_cleanly(monkeypatch, tmp_path, component):
    """The signal handlers are in place before the start: SIGTERM while the model loads (here:
    a start that never returns) cancels the start and runs the close, instead of the default
    action killing the process half-started (exit -15, nothing closed)."""
    import os
    import signal

    closed = []
    if component == "worker":
        from tests.integration.conftest import worker_config
        from worker.serve.worker import Worker

        app = Worker(worker_config(("127.0.0.1:1", "redis://127.0.0.1:1/0"), "p", metrics={"port": None}))
        monkeypatch.setattr(app, "close", lambda: _record(closed))
    else:
        from tests.integration.gateway_helpers import gateway_config
        from worker.gateway.app import Gateway

        app = Gateway(gateway_config(("127.0.0.1:1", "redis://127.0.0.1:1/0"), "p", tmp_path))
        monkeypatch.setattr(app, "stop", lambda: _record(closed))
    monkeypatch.setattr(app, "start", lambda: forever(swallow=False))

    def unhandled(*_):  # the app had not put its handler in place: fail here, not by a killed pytest
        raise AssertionError("SIGTERM during the start reached the process's own handler")

    async def main():
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
        await app.run()

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        _, took = timed(main())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert closed == [True] and took < 5


async def _record(seen: list) -> None:
    seen.append(True)


def _scaled(fn, factor: float):
    """`stop_within` with every bound multiplied by `factor` (seconds become tens of ms)."""
    async def scaled(what, aw, timeout_s):
        return await fn(what, aw, timeout_s * factor)
    return scaled


def test_no_asyncio_wait_for_in_the_tree():
    """Python 3.11's `asyncio.wait_for` waits for a cancelled call to finish (a stop that
    swallows its cancellation hangs it for ever) and can lose a cancellation that arrives
    as the call completes (a loop around it may never stop; python/cpython#86296).
    Reads use `asyncio.timeout`, stop steps `worker.obs.stopping.stop_within`, tests
    waiting for a task `tests.integration.helpers.finished_within`."""
    assert not code_matching(lambda node: isinstance(node, ast.Attribute) and node.attr == "wait_for"
                             and isinstance(node.value, ast.Name) and node.value.id == "asyncio")


def test_no_cancellation_is_suppressed():
    """`with suppress(asyncio.CancelledError): await task` (after `task.cancel()`) also
    swallows a cancellation of the caller itself, whose stop then never ends: wait for
    the cancelled task with `asyncio.wait({task})` instead."""
    def suppresses_cancel(node) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "suppress"
                and any(isinstance(a, ast.Attribute) and a.attr == "CancelledError"
                        or isinstance(a, ast.Name) and a.id == "BaseException" for a in node.args))

    assert not code_matching(suppresses_cancel)


def code_matching(predicate) -> list[str]:
    """`path:line` of every AST node of the tree's Python files for which `predicate` holds."""
    return [f"{p.relative_to(ROOT)}:{node.lineno}" for folder in ("worker", "schemas", "tools", "tests")
            for p in sorted((ROOT / folder).rglob("*.py")) for node in ast.walk(ast.parse(p.read_text()))
            if predicate(node)]


class PlantedPing:
    """A `ping()` that completes exactly when the test cancels the task awaiting it: the
    reply and the cancel land in the same turn of the event loop. Python 3.11's
    `asyncio.wait_for` around such a call returned its result and dropped the
    cancellation, so a readiness loop built on it never stopped and the gateway's stop
    (which waits for that loop) hung for ever: the CI hang of issue 55."""

    def __init__(self) -> None:
        self.awaited = asyncio.Event()
        self.reply: asyncio.Future | None = None

    async def ping(self) -> bool:
        self.reply = asyncio.get_running_loop().create_future()
        self.awaited.set()
        return await self.reply

    async def cancel_as_it_replies(self, task: asyncio.Task) -> bool:
        """True when `task` ended cancelled within 2 s of the cancel."""
        await self.awaited.wait()
        self.reply.set_result(True)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        return bool(done) and task.cancelled()


def test_the_gateways_readiness_loop_stops_when_cancelled_as_a_check_replies(monkeypatch, tmp_path):
    from tests.integration.gateway_helpers import gateway_config
    from worker.gateway import app
    from worker.gateway.files import FileStore

    monkeypatch.setattr(app, "CHECK_INTERVAL_S", 0.0)
    planted = PlantedPing()

    async def main():
        gw = app.Gateway(gateway_config(("127.0.0.1:1", "redis://127.0.0.1:1/0"), "p", tmp_path))
        async def answered() -> None:
            return None

        gw.client = type("Client", (), {"redis": planted, "ping_kafka": staticmethod(answered),
                                        "live_workers": staticmethod(answered)})()
        gw.files = FileStore(str(tmp_path))
        return await planted.cancel_as_it_replies(asyncio.ensure_future(gw._check_loop()))

    assert asyncio.run(main())


def test_the_workers_health_loop_stops_when_cancelled_as_a_check_replies():
    from worker.config import MetricsConfig
    from worker.obs.metrics import Metrics
    from worker.serve.health import HealthChecks

    planted = PlantedPing()

    async def main():
        checks = HealthChecks(Metrics(), liveness=lambda: (True, {}))
        checks._parts = {"redis": planted}
        return await planted.cancel_as_it_replies(asyncio.ensure_future(checks.run(MetricsConfig(check_interval_s=0.001))))

    assert asyncio.run(main())


def test_a_loop_stops_although_a_call_in_it_swallowed_its_cancellation():
    """`honour_cancellation` at the top of each round: a background loop whose awaited call
    catches `CancelledError` (as aiokafka's offset lookup did under a drain) still stops
    at the end of that round; without it the loop runs on (the readiness checks ran 12 s
    past a stop)."""
    from worker.obs.stopping import honour_cancellation

    async def swallowing() -> None:
        try:  # noqa: SIM105 (spelled out: what such a library does)
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass

    async def loop(rounds: list[int], honour: bool) -> None:
        while True:
            if honour:
                honour_cancellation()
            rounds.append(1)
            await swallowing()

    async def main(honour: bool):
        rounds: list[int] = []
        task = asyncio.create_task(loop(rounds, honour))
        await asyncio.sleep(0.05)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        return task in done and task.cancelled(), len(rounds)

    assert asyncio.run(main(True)) == (True, 1)


class SwallowingClient:
    """A client whose every call swallows the caller's cancellation (as aiokafka's offset
    lookup did) and replies; the calls after that wait 10 s, as a dead connection would."""

    def __init__(self) -> None:
        self.calls = 0
        self.awaited = asyncio.Event()

    async def _call(self, *args, **kwargs):
        self.calls += 1
        self.awaited.set()
        try:  # noqa: SIM105 (spelled out: what such a library does)
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass
        return True

    ping = ping_kafka = _call
    subscribed = True

    async def get_message(self, timeout: float):
        await self._call()
        return None  # nothing arrived

    @property
    def redis(self):
        return self


def cancel_and_see_it_end(task: asyncio.Task, client: SwallowingClient):
    async def run() -> bool:
        waiting = asyncio.ensure_future(client.awaited.wait())
        await asyncio.wait({waiting, task}, timeout=2, return_when=asyncio.FIRST_COMPLETED)
        assert client.awaited.is_set(), task  # the loop reached the client (else it failed first)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        return bool(done) and task.cancelled()

    return run()


def test_the_gateways_background_loops_stop_although_a_client_swallowed_the_cancel(monkeypatch, tmp_path):
    """The kind of the worker's readiness checks running 12 s past a drain, in the gateway and
    the client: the readiness loop and the pub/sub reader each end at the top of their next
    round (`honour_cancellation`) when an awaited call swallowed their cancellation."""
    from tests.integration.gateway_helpers import gateway_config
    from worker.client.subscriber import SharedSubscriber
    from worker.gateway import app
    from worker.gateway.files import FileStore

    monkeypatch.setattr(app, "CHECK_INTERVAL_S", 0.0)

    async def gateway_loop() -> bool:
        client = SwallowingClient()
        gw = app.Gateway(gateway_config(("127.0.0.1:1", "redis://127.0.0.1:1/0"), "p", tmp_path))
        gw.client = client
        gw.files = FileStore(str(tmp_path))
        return await cancel_and_see_it_end(asyncio.ensure_future(gw._check_loop()), client)

    async def subscriber_loop() -> bool:
        client = SwallowingClient()
        sub = SharedSubscriber(redis=None)
        sub._pubsub = client
        return await cancel_and_see_it_end(asyncio.ensure_future(sub._read()), client)

    assert asyncio.run(gateway_loop())
    assert asyncio.run(subscriber_loop())


def run_logging_script(tmp_path, source: str, timeout_s: float):
    """Run `source` as a script in a fresh interpreter from the repository root, with a log
    file's path as its argument: (the finished process, the log file's text)."""
    import subprocess
    import sys

    script, log_file = tmp_path / "script.py", tmp_path / "log.txt"
    script.write_text(source)
    proc = subprocess.run([sys.executable, str(script), str(log_file)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)
    return proc, log_file.read_text() if log_file.exists() else ""


def test_exit_now_flushes_logs_and_streams_and_skips_the_teardown(tmp_path):
    """A stopped worker (and its core process) exits with `exit_now`: the log line and the
    unflushed standard streams are written, the exit code kept, and the interpreter's
    teardown skipped (an atexit handler, the marker of teardown, never runs)."""
    proc, log = run_logging_script(tmp_path, (
        "import atexit, logging, sys\n"
        "from worker.obs.exits import exit_now\n"
        "logging.basicConfig(stream=open(sys.argv[1], 'w'), level=logging.INFO)\n"
        "logging.getLogger('w').info('worker stopped')\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "sys.stdout.write('no newline yet')\n"
        "exit_now(3)\n"), timeout_s=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "no newline yet"
    assert "worker stopped" in log


def test_a_core_process_whose_step_fails_exits_1_with_its_traceback_logged(tmp_path):
    """The engine core's failure path (which ends through `exit_now`, as its stop does):
    exit code 1, nothing after `serve_core` runs, and the traceback is in the log."""
    proc, log = run_logging_script(tmp_path, (
        "import logging, sys\n"
        "from multiprocessing import Pipe\n"
        "from worker.engine.core_proc import serve_core\n"
        "logging.basicConfig(stream=open(sys.argv[1], 'w'), level=logging.INFO)\n"
        "class FailingCore:\n"
        "    def has_unfinished(self): return True\n"
        "    def step(self): raise RuntimeError('a broken invariant')\n"
        "conn_in, _ = Pipe(duplex=False)\n"
        "reader, conn_out = Pipe(duplex=False)\n"
        "closed = []\n"
        "serve_core(FailingCore(), conn_in, conn_out, on_close=lambda: closed.append(1))\n"
        "print('serve_core returned')\n"), timeout_s=120)
    assert proc.returncode == 1, proc.stderr
    assert "serve_core returned" not in proc.stdout
    assert "engine step failed" in log and "RuntimeError: a broken invariant" in log
