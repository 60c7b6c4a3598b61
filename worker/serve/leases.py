"""Claim leases: keeping this worker's claims alive, and what happens when one is lost.

Every third of `redis.claim_lease_ms` the claims of every job held here (claimed, in the
engine, finishing) are renewed in one round trip. A claim that is another worker's now
(this one stalled past its lease, or Redis lost the claim and a restore gave it away)
means the job is that worker's: it is aborted here, nothing more of it is published or
recorded (a terminal event not yet published is dropped: the holder's counts), its
records go back to the intake as contested, their offsets open until the holder's
terminal event appears, and the failure mark of its attempt is cleared (this worker
lived: the attempt is no evidence the job kills workers; `claims.py`). A renewal that finds Redis empty (a new dataset epoch) restores
first (`Publisher.restore`: claims, then logs) and renews at the next turn.

Owned by the worker; the only writer of the lease-loss outcome in the job table
(`JobTable.disown`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

import structlog

from worker.obs.stopping import honour_cancellation
from worker.security.redis import REDIS_DOWN
from worker.serve.claims import ClaimStore, EpochChanged
from worker.serve.jobs import JobState, JobTable

if TYPE_CHECKING:
    from worker.obs.metrics import Metrics
    from worker.serve.read_ahead import JobRecord

log = structlog.get_logger(__name__)

WARN_EVERY_S = 10.0  # while Redis is unreachable, one warning per this many seconds


class LeaseHost(Protocol):
    """What the leases need of the worker around them (`worker.serve.worker.Worker`)."""

    def abort_in_engine(self, job_id: str) -> None:
        """Abort the job's request in the engine (its KV freed at the next step)."""

    def retake(self, records: list[JobRecord]) -> None:
        """Hand records back to the intake as contested (offsets open until the job ends)."""

    async def restore_redis(self, stale_epoch: str) -> None:
        """Redis lost its data: re-claim the held jobs and re-append their logs."""


class ClaimLeases:
    """Renews the claims of the jobs this worker holds and hands back those it lost.

    Args:
        table: the worker's job table.
        claims: the claim store (Redis).
        metrics: counts `request_abort_total{reason="lease_lost"}`.
        lease_ms: `redis.claim_lease_ms`; renewed every third of it.
        host: the worker (abort, retake, restore).
    """

    def __init__(self, table: JobTable, claims: ClaimStore, metrics: Metrics, lease_ms: int, host: LeaseHost) -> None:
        self.table = table
        self.claims = claims
        self.metrics = metrics
        self.lease_ms = lease_ms
        self.host = host
        self._warned = 0.0  # time.monotonic() of the last "Redis unreachable" warning
        self._clearing: set[asyncio.Task] = set()  # failure marks being cleared (`hand_back_lost`)

    async def run(self) -> None:
        """Renew until cancelled."""
        while True:
            honour_cancellation()
            await asyncio.sleep(self.lease_ms / 3000)
            held = {held.job_id: (held.claim_token, held.attempt) for held in self.table.holding_claims()}
            try:
                try:
                    lost = await self.claims.renew(held)
                except EpochChanged as e:  # Redis lost its data: restore (claims first), renew next time
                    await self.host.restore_redis(e.epoch)
                    continue
            except REDIS_DOWN as e:
                if time.monotonic() - self._warned > WARN_EVERY_S:
                    self._warned = time.monotonic()
                    log.warning("claim renewal failed (Redis unreachable); retrying", error=repr(e)[:200])
                continue
            self.hand_back_lost(sorted(lost))

    def hand_back_lost(self, job_ids: list[str]) -> None:
        """Another worker holds these jobs' claims now: stop running them, publish and
        record nothing more of theirs, retake their records as contested.

        A job whose terminal event is already numbered is not lost, whatever the renewal
        said: the renewal's snapshot was taken before that event's publish script ended
        the claim (the claim deleted, the done mark set), so a renewal that runs after it
        finds no claim of ours. Its fate is the publisher's: published, it is recorded as
        usual; refused (the claim really was taken), the publisher hands it back itself."""
        alive: list[tuple[str, str, int]] = []
        for job_id in job_ids:
            held = self.table.get(job_id)
            if held is None or held.terminal_published:
                continue
            was_running = held.state != JobState.FINISHING
            held = self.table.disown(job_id)
            if held is None:
                continue
            log.warning("claim lost; handing the job back", job_id=job_id, attempt=held.attempt)
            if was_running:
                self.host.abort_in_engine(job_id)
            self.metrics.aborted.labels("lease_lost").inc()
            self.host.retake(held.retake_records())
            alive.append((job_id, held.claim_token, held.attempt))
        if alive:  # this worker is alive: its attempts did not die with it (no poison evidence)
            task = asyncio.get_running_loop().create_task(self._clear_failure_marks(alive))
            self._clearing.add(task)
            task.add_done_callback(self._clearing.discard)

    async def _clear_failure_marks(self, attempts: list[tuple[str, str, int]]) -> None:
        """Clear the failure marks of attempts this worker lost but lived through (the
        claim stays whoever's it is now: `ClaimStore.release` deletes only ours). A job
        at its failure limit waits `worker.poison_grace_s` for exactly this
        (`JobStarter._suspects_wait`). Unreachable Redis: the marks stay (logged)."""
        try:
            await self.claims.release(attempts)
        except REDIS_DOWN as e:
            log.warning("could not clear the failure marks of jobs handed back; they count toward poison",
                        job_ids=[j for j, _, _ in attempts][:20], error=repr(e)[:200])
