"""Processes the integration tests start (workers, CLI commands), each registered, so that
every one is stopped and reaped when its test ends, whether the test passed, failed or
hung: the autouse fixture `reap_spawned` (tests/integration/conftest.py) calls `reap`
after each test. A process a test killed is waited for there too (no zombie is left
behind, as a killed worker was when a test hung before its own clean-up)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import yaml

from schemas.wire import Started
from tests.integration.helpers import START_S

ROOT = Path(__file__).resolve().parents[2]
SPAWNED: list[subprocess.Popen] = []  # every process started through `spawn` since the last `reap`


def spawn(args: list[str], **popen: object) -> subprocess.Popen:
    """`subprocess.Popen(args, **popen)`, registered for `reap`."""
    proc = subprocess.Popen(args, **popen)
    SPAWNED.append(proc)
    return proc


def reap(grace_s: float = 20.0) -> list[str]:
    """Stop every registered process still running (SIGTERM, then SIGKILL after `grace_s`
    seconds) and wait for every one of them, killed earlier or not; forget them. Returns
    a line for each process that was still running (a test that did not stop it)."""
    left = []
    running = [p for p in SPAWNED if p.poll() is None]
    for p in running:
        left.append(f"pid {p.pid}: {' '.join(map(str, p.args))[:200]}")
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    for p in SPAWNED:
        try:
            p.wait(10)  # a killed process is reaped here
        except subprocess.TimeoutExpired:
            left.append(f"pid {p.pid}: did not exit after SIGKILL")
    SPAWNED.clear()
    return left


def spawn_worker(tmp_path: Path, cfg, worker_id: str, command: tuple[str, ...] = ("worker", "worker"),
                 extra: tuple[str, ...] = (), new_session: bool = False) -> tuple[subprocess.Popen, Path]:
    """`python -m <command> --config <cfg as YAML> <extra>` in its own process, stderr to a
    log file; `command` defaults to the CLI's `inflight worker`. `new_session`: the
    process leads a process group of its own (with the processes it starts), which a
    test may signal as a whole (`os.killpg(proc.pid, sig)`)."""
    data = msgspec.to_builtins(cfg)
    data["worker"]["worker_id"] = worker_id
    path = tmp_path / f"{worker_id}.yaml"
    path.write_text(yaml.safe_dump(data))
    log = tmp_path / f"{worker_id}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as err:  # the child keeps its own copy of the descriptor
        proc = spawn([sys.executable, "-m", *command, "--config", str(path), *extra],
                     stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT, start_new_session=new_session)
    return proc, log


def torch_libraries(pid: int) -> list[str]:
    """The shared libraries of torch that process `pid` has mapped (/proc/PID/maps, Linux)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if "/torch/lib/" in line})


def kill_9(proc: subprocess.Popen) -> None:
    """SIGKILL and wait (reaped at once: the test reads its return code)."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


async def wait_started(log: Path, proc: subprocess.Popen, timeout: float = START_S) -> None:
    """Until the worker's log says "worker started" (RuntimeError if it exits first,
    TimeoutError after `timeout` seconds; the bound is `helpers.START_S`'s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited: {log.read_text()[-3000:]}")
        if "worker started" in log.read_text():
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no 'worker started' within {timeout:g} s; its log ends: {log.read_text()[-3000:]}")


async def wait_for_starts(client, ids, worker_id: str, n: int, timeout: float = 60.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        on = set()
        for j in ids:
            evs = await client.read_log(j)
            if any(isinstance(e, Started) and e.worker_id == worker_id for e in evs):
                on.add(j)
        if len(on) >= n:
            return on
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{worker_id} started fewer than {n} jobs")
