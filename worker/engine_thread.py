"""The engine thread: owns the Engine and runs `step()` in a loop, so a GPU step never
blocks the asyncio thread (Kafka heartbeats, Redis, cancels keep flowing).

Requests and aborts go in through the Engine's thread-safe `add_request` / `abort`;
each step's outputs come back to the asyncio loop with `call_soon_threadsafe`, in
step order.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from worker.engine import Engine, RequestOutput

if TYPE_CHECKING:
    from worker.metrics import Metrics

log = structlog.get_logger(__name__)

IDLE_METRICS_INTERVAL_S = 0.5


class EngineThread:
    """Args:
    engine: the Engine (only this thread calls `step`).
    loop: the asyncio loop that receives outputs.
    on_step: called on the loop with the outputs of every step that produced any.
    on_crash: called on the loop with the exception if `step` raises (the worker then
        stops without committing the affected offsets; the jobs are redelivered).
    metrics: if given, `observe_step` after every step and `observe_idle` every
        0.5 s while idle, on this thread.
    """

    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        on_step: Callable[[list[RequestOutput]], None],
        on_crash: Callable[[BaseException], None],
        metrics: Metrics | None = None,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_step = on_step
        self._on_crash = on_crash
        self._metrics = metrics
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)
        self.num_steps = 0
        self.last_step_time = 0.0

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Call after add_request / abort so an idle engine notices at once."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        engine = self.engine
        metrics = self._metrics
        last_idle_report = 0.0
        try:
            while not self._stop.is_set():
                if not engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    self.last_step_time = now = time.monotonic()
                    if metrics is not None and now - last_idle_report >= IDLE_METRICS_INTERVAL_S:
                        last_idle_report = now
                        metrics.observe_idle(engine.kv_stats(), 0, 0)
                    continue
                outputs = engine.step()
                self.num_steps += 1
                self.last_step_time = time.monotonic()
                if metrics is not None:
                    metrics.observe_step(engine.last_step_stats)
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_step, outputs)
        except BaseException as e:  # the engine is broken: tell the worker, which stops
            log.exception("engine step failed")
            self._loop.call_soon_threadsafe(self._on_crash, e)
