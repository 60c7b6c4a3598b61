"""A healthy start logs no warning or error: `inflight worker` against a Kafka broker
started a moment before (its group coordinator still being created, as in the demo and
on a fresh cluster), then a second worker joining (a rebalance). Uses a throwaway
broker of tools/stack/devstack.sh on free ports with its own state directory, beside the dev
stack's Redis; `down` stops only that broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from tests.integration.conftest import ROOT
from tests.integration.helpers import START_S
from tests.integration.processes import spawn, torch_libraries
from tools.stack.own_stack import free_port

pytestmark = pytest.mark.slow


class WorkerProcess:
    """`python -m worker worker` with its JSON log lines collected as they come."""

    def __init__(self, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.stop_s: float | None = None  # SIGTERM to exit, seconds
        self.proc = spawn([sys.executable, "-m", "worker", "worker"], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def events(self) -> list[dict]:
        return [json.loads(x) for x in list(self.lines)]

    def wait_for(self, event: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(e.get("event") == event for e in self.events()):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {event!r} within {timeout_s} s; log:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            t0 = time.monotonic()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.stop_s = time.monotonic() - t0
        self._reader.join(10)


def test_worker_start_on_a_fresh_broker_and_a_rebalance_log_no_warning_or_error(services, llama_path, tmp_path):
    redis_url = services[1]
    redis_port = redis_url.rsplit(":", 1)[1].split("/")[0]
    kafka_port = free_port(pair=True)
    stack_env = {**os.environ, "INFLIGHT_DEV_KAFKA_PORT": str(kafka_port), "INFLIGHT_DEV_REDIS_PORT": redis_port,
                 "INFLIGHT_DEV_STATE": str(tmp_path / "devstack")}
    devstack = str(ROOT / "tools" / "stack" / "devstack.sh")
    prefix = f"q{uuid.uuid4().hex[:8]}"
    worker_env = {**os.environ, "PYTHONPATH": str(ROOT), "INFLIGHT_MODEL__PATH": str(llama_path),
                  "INFLIGHT_MODEL__DEVICE": "cpu", "INFLIGHT_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{kafka_port}",
                  "INFLIGHT_KAFKA__GROUP_ID": f"{prefix}-workers", "INFLIGHT_REDIS__URL": redis_url,
                  "INFLIGHT_REDIS__KEY_PREFIX": prefix, "INFLIGHT_METRICS__PORT": "0",
                  "INFLIGHT_METRICS__HOST": "127.0.0.1", "INFLIGHT_SERVING_TUNING__MAX_TOTAL_TOKENS": "2048",
                  "INFLIGHT_KAFKA__SESSION_TIMEOUT_MS": "6000", "INFLIGHT_KAFKA__HEARTBEAT_INTERVAL_MS": "1000"}
    workers: list[WorkerProcess] = []
    try:
        subprocess.run([devstack, "up"], env=stack_env, cwd=ROOT, check=True, capture_output=True, timeout=180)
        first = WorkerProcess(worker_env)  # at once: the broker has no __consumer_offsets yet
        workers.append(first)
        # "partitions assigned" can come before the start ends; a SIGTERM then is another
        # test's case (tests/unit/test_stopping.py): here both starts end first
        first.wait_for("worker started", START_S)
        # the front process tokenizes with the tokenizer its engine core sent: no torch in it
        assert torch_libraries(first.proc.pid) == [], "the worker's front process loaded torch"
        first.wait_for("partitions assigned", START_S)
        second = WorkerProcess(worker_env)
        workers.append(second)
        second.wait_for("worker started", START_S)
        second.wait_for("partitions assigned", START_S)
        first.wait_for("partitions revoked", 30)
    finally:
        for w in workers:
            w.stop()
        subprocess.run([devstack, "down"], env=stack_env, cwd=ROOT, capture_output=True, timeout=120)
    events = [e for w in workers for e in w.events()]
    loud = [e for e in events if e.get("level") not in ("debug", "info")]
    assert loud == [], loud
    assert [w.proc.returncode for w in workers] == [0, 0], [(w.stop_s, w.lines[-15:]) for w in workers]
    assert sum(e["event"] == "worker stopped" for e in events) == 2
    # the conditions happened and were logged quietly (the first worker always meets the
    # coordinator being created; the rebalance may or may not refuse a heartbeat)
    quiet = {e["transient"] for e in events if "transient" in e}
    assert "coordinator_unavailable" in quiet, [e["event"] for e in events]
