"""The engine thread: owns the Engine and runs `step()` in a loop, so a GPU step never
blocks the asyncio thread (Kafka heartbeats, Redis, cancels keep flowing).

Requests and aborts go in through the Engine's thread-safe `add_request` / `abort`;
each step's outputs come back to the asyncio loop with `call_soon_threadsafe`, in
step order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import structlog

from worker.engine import Engine, KVStats, RequestOutput

log = structlog.get_logger(__name__)


class EngineThread:
    """Args:
    engine: the Engine (only this thread calls `step`).
    loop: the asyncio loop that receives outputs.
    on_step: called on the loop with (outputs, kv stats after the step) for every step
        that produced outputs.
    on_crash: called on the loop with the exception if `step` raises (the worker then
        stops without committing the affected offsets; the jobs are redelivered).
    """

    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        on_step: Callable[[list[RequestOutput], KVStats], None],
        on_crash: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_step = on_step
        self._on_crash = on_crash
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

    def _run(self) -> None:
        import time

        engine = self.engine
        try:
            while not self._stop.is_set():
                if not engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    self.last_step_time = time.monotonic()
                    continue
                outputs = engine.step()
                self.num_steps += 1
                self.last_step_time = time.monotonic()
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_step, outputs, engine.kv_stats())
        except BaseException as e:  # the engine is broken: tell the worker, which stops
            log.exception("engine step failed")
            self._loop.call_soon_threadsafe(self._on_crash, e)
