"""The engine's thread budget: how many intra-op threads torch may use, sized from the
CPUs this process may run on and shared among the engines of one host.

torch defaults to one intra-op thread per core. Alone on a host that costs nothing, but
an engine beside anything busy (its own worker's event loop, a second worker, Kafka and
Redis in a dev stack) collapses: OpenMP threads spin-wait for each other at every
parallel region, and one of them descheduled stalls the whole step (measured on 2
cores: two engines at once ran at 118 + 116 tokens/s with 2 threads each, 1155 + 1169
with 1 each). vLLM's CPU engine binds its threads and leaves a core to its front end for
the same reason. The rule here:

    cpus      = the affinity mask, capped by the cgroup CPU quota (cgroup v2 `cpu.max`
                or v1 `cpu.cfs_quota_us`), rounded down, at least 1
    reserve   = `FRONT_END_CPUS` (the worker's event loop: Kafka, Redis,
                detokenization) when the engine runs in its own process, else 0
    engines   = live engines on this host (each holds a lock file, `EngineRegistry`)
    threads   = max(1, (cpus - reserve * engines) // engines)

`worker.engine_threads` overrides it. An engine re-reads the registry every
`RECHECK_S` between steps and lowers or raises its threads as engines come and go
(`torch.set_num_threads` takes effect at the next parallel region), so engines started
one after another never oversubscribe the host. Inter-op threads are set to 1: the
engine runs one graph at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FRONT_END_CPUS = 1
RECHECK_S = 5.0


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup quota allows (quota / period), or None when unlimited or unknown.
    Reads cgroup v2 (`cpu.max`: "max 100000" or "200000 100000") or v1
    (`cpu/cpu.cfs_quota_us`, -1 = unlimited, and `cpu/cpu.cfs_period_us`)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by the cgroup quota, at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, max(1, math.floor(limit)))
    return max(1, n)


def plan_threads(cpus: int, engines: int, own_process: bool, setting: int | None = None) -> int:
    """Intra-op threads for one engine (the module docstring's rule).

    Args:
        cpus: usable CPUs (`usable_cpus`).
        engines: live engines on the host, this one included (>= 1).
        own_process: the engine runs in its own process (then its front end keeps
            `FRONT_END_CPUS`); False when it steps in a thread of the worker.
        setting: `worker.engine_threads`; wins when set.
    """
    if setting is not None:
        return setting
    engines = max(1, engines)
    reserve = FRONT_END_CPUS if own_process else 0
    return max(1, (cpus - reserve * engines) // engines)


class EngineRegistry:
    """The engines alive on this host: one lock file each in `directory` (default
    `<tmp>/inflight-engines`), held with `flock` for the process's life, so a crashed
    engine's entry frees itself. Counting tries each file's lock: a file whose lock can
    be taken belongs to no live engine and is removed."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory or Path(tempfile.gettempdir()) / "inflight-engines")
        self._fd: int | None = None
        self.path: Path | None = None

    def register(self) -> None:
        """Take this process's entry. OSError (a read-only temp directory) leaves it
        unregistered: then it counts only itself."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"engine-{os.getpid()}-{time.monotonic_ns()}.lock"
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._fd = fd

    def count(self) -> int:
        """Live engines here, this one included (at least 1)."""
        live = 0
        try:
            entries = list(self.directory.glob("engine-*.lock"))
        except OSError:
            return 1
        for path in entries:
            if path == self.path:
                live += 1
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue  # removed meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                live += 1  # held: a live engine
            else:
                path.unlink(missing_ok=True)  # nobody holds it: a dead engine's
            finally:
                os.close(fd)
        return max(1, live + (0 if self._fd is not None else 1))

    def close(self) -> None:
        if self._fd is not None:
            if self.path is not None:
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


@dataclass
class ThreadBudget:
    """Applies the thread rule to this process and keeps it current.

    Args:
        own_process: the engine has its own process (`worker.engine_process`).
        setting: `worker.engine_threads` (None = the rule).
        registry: where engines of this host register (a fresh default one if None).
    """

    own_process: bool
    setting: int | None = None
    registry: EngineRegistry | None = None
    threads: int = 0
    engines: int = 1
    _last_check: float = 0.0

    def start(self) -> int:
        """Register, size and set the threads (before the model loads). Returns them."""
        import torch

        if self.registry is None:
            self.registry = EngineRegistry()
        try:
            self.registry.register()
        except OSError as e:
            log.info("engine registry unavailable (%s); sizing threads for this engine alone", e)
        self._apply(torch, force=True)
        with contextlib.suppress(RuntimeError):  # already set, or parallel work ran: keep torch's
            torch.set_num_interop_threads(1)
        return self.threads

    def recheck(self, now: float | None = None) -> None:
        """Between steps: follow engines that started or stopped (at most every `RECHECK_S`)."""
        now = time.monotonic() if now is None else now
        if self.setting is not None or now - self._last_check < RECHECK_S:
            return
        import torch

        self._apply(torch)

    def _apply(self, torch, force: bool = False) -> None:
        self._last_check = time.monotonic()
        engines = self.registry.count() if self.registry is not None else 1
        threads = plan_threads(usable_cpus(), engines, self.own_process, self.setting)
        if force or threads != self.threads:
            torch.set_num_threads(threads)
            if self.threads and threads != self.threads:
                log.info("engine threads %d -> %d (%d engines on this host)", self.threads, threads, engines)
            self.threads, self.engines = threads, engines

    def close(self) -> None:
        if self.registry is not None:
            self.registry.close()
