"""Who may enter the engine now: the gate that runs a suspect job alone.

A job whose earlier attempt never ended (its worker died running it: a forward that
kills the process, as a crashing kernel would) is *isolated*: it waits until this
worker's engine is empty, and no other job enters the engine until it has left. If it
kills this worker too, the death is its own (`worker.serve.starter` counts the marks).

    other jobs ──► pass ───────────────────────────────────────────► engine
                    │ (wait while a job runs alone or one waits to)
    isolated ────► wait: engine empty, nobody alone ──► alone ──► engine ──► done: gate open

Owned by the job starter, on the event loop; it reads the job table (never writes it).
The state is three numbers: the job running alone, the isolated jobs waiting, and the
inputs past the gate not yet answered by the engine (`entering`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from worker.serve.jobs import JobState, JobTable
from worker.serve.local_job import LocalJob

POLL_S = 0.02  # how often a waiting job looks again, seconds: job ends are not signalled here


class IsolationGate:
    """Lets a suspect job into the engine alone, and no other job while it runs.

    Args:
        table: the worker's job table (read: which jobs are in the engine).
    """

    def __init__(self, table: JobTable) -> None:
        self.table = table
        self._alone: str | None = None  # the job running alone, if any
        self._num_waiting = 0  # isolated jobs waiting for their turn (they hold the gate shut)
        self._num_entering = 0  # inputs past the gate, not yet answered by the engine

    @property
    def is_shut(self) -> bool:
        """A job runs alone, or an isolated one waits for the engine to empty: no other
        job enters."""
        return bool(self._num_waiting) or self._alone_running()

    def must_wait(self, held: LocalJob) -> bool:
        """The job cannot pass at once (it is isolated, or the gate is shut)."""
        return held.isolated or self.is_shut

    async def wait_turn(self, held: LocalJob) -> bool:
        """Wait until `held` may enter the engine: an isolated job until the engine is
        empty and nobody runs alone (then it is the one alone), any other while the gate
        is shut. False if the job left CLAIMED meanwhile (a cancel, a drain)."""
        if not held.isolated:
            while self.is_shut:
                if held.state != JobState.CLAIMED:
                    return False
                await asyncio.sleep(POLL_S)
            return held.state == JobState.CLAIMED
        self._num_waiting += 1
        try:
            while self._alone_running() or self._engine_busy():
                if held.state != JobState.CLAIMED:
                    return False
                await asyncio.sleep(POLL_S)
            self._alone = held.job_id
        finally:
            self._num_waiting -= 1
        return held.state == JobState.CLAIMED

    def release(self, held: LocalJob) -> None:
        """`held` will not enter after all (its running mark could not be set)."""
        if self._alone == held.job_id:
            self._alone = None

    @contextlib.contextmanager
    def entering(self) -> Iterator[None]:
        """Around an input's processing and submission: the engine counts as busy."""
        self._num_entering += 1
        try:
            yield
        finally:
            self._num_entering -= 1

    def _engine_busy(self) -> bool:
        return self._num_entering > 0 or any(j.state == JobState.IN_ENGINE for j in self.table)

    def _alone_running(self) -> bool:
        """A job runs alone now (forgets it once it has left the engine)."""
        if self._alone is None:
            return False
        alone = self.table.get(self._alone)
        if alone is None or alone.state not in (JobState.CLAIMED, JobState.IN_ENGINE):
            self._alone = None
            return False
        return True
