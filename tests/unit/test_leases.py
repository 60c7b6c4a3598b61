"""Claim leases (`worker.serve.leases.ClaimLeases`) without Redis: what a renewal that
reports claims lost does to the jobs held here. A job whose claim another worker took is
aborted and handed back; a job whose own terminal event ended its claim is not (the
renewal raced that event's publish: seen in CI as "claim lost; handing the job back" for
jobs that then finished, their traces ending `lost` without `results.write`)."""

from __future__ import annotations

import asyncio

import pytest

from schemas.wire import Job
from tests.unit.test_jobs import out
from worker.obs.metrics import Metrics
from worker.serve.claims import Claimed
from worker.serve.jobs import JobState, JobTable
from worker.serve.leases import ClaimLeases
from worker.serve.read_ahead import JobRecord


class Host:
    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.retaken: list[str] = []

    def abort_in_engine(self, job_id: str) -> None:
        self.aborted.append(job_id)

    def retake(self, records: list[JobRecord]) -> None:
        self.retaken += [r.job.job_id for r in records]

    async def restore_redis(self, stale_epoch: str) -> None:
        raise AssertionError("no restore expected")


class Claims:
    """One renewal: every claim asked for is lost, after the publisher (the test's
    `meanwhile`) ran while the renewal was in flight; then the lease loop is cancelled
    (at its next sleep), so exactly one renewal runs."""

    def __init__(self, meanwhile) -> None:
        self.meanwhile = meanwhile
        self.asked: list[str] = []

    async def renew(self, claims: dict[str, tuple[str, int]]) -> set[str]:
        self.asked = sorted(claims)
        self.meanwhile()
        asyncio.current_task().cancel()
        return set(claims)

    async def release(self, claims: list[tuple[str, str, int]]) -> None:
        self.released = sorted(claims)


def held_jobs():
    """Two jobs held here: "running" (in the engine) and "finished" (its terminal event
    drafted, not yet numbered by a publisher round)."""
    table = JobTable("w1")
    for jid in ("running", "finished"):
        table.open(JobRecord(Job(job_id=jid, prompt="hi"), "normal", "tp", 1, 100.0, None, None),
                   Claimed("tok", 1, 0, 0, False))
        table.accepted(jid)
    table.apply_outputs([out("finished", [1], "a", "length")])
    return table


def run_one_renewal(table: JobTable, meanwhile) -> tuple[Host, Metrics, Claims]:
    host, metrics, claims = Host(), Metrics(), Claims(meanwhile)
    leases = ClaimLeases(table, claims, metrics, lease_ms=30, host=host)
    with pytest.raises(asyncio.CancelledError):  # the fake ended the loop after one renewal
        asyncio.run(leases.run())
    return host, metrics, claims


def lost_count(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("request_abort_total", {"reason": "lease_lost"})


def test_a_renewal_that_raced_the_jobs_own_terminal_event_hands_it_not_back():
    table = held_jobs()
    finished = table.get("finished")
    rounds = []

    # the publisher numbers "finished"'s terminal event (its script then ends the claim)
    # while the renewal, whose snapshot still held the claim, is in flight
    host, metrics, claims = run_one_renewal(table, lambda: rounds.append(table.drain()))
    assert claims.asked == ["finished", "running"]
    assert rounds[0].finished == [finished] and finished.terminal_published
    assert table.get("finished") is finished and finished.state == JobState.FINISHING  # recorded as usual
    assert host.retaken == ["running"] and host.aborted == ["running"]  # really lost
    assert lost_count(metrics) == 1


def test_claims_another_worker_took_are_handed_back_and_aborted():
    table = held_jobs()
    host, metrics, _ = run_one_renewal(table, lambda: None)  # nothing published meanwhile: both really lost
    assert sorted(host.retaken) == ["finished", "running"]
    assert host.aborted == ["running"]  # the finished one is out of the engine already
    assert len(table) == 0 and lost_count(metrics) == 2
    assert not table.drain()  # its terminal event is dropped: the holder's counts


def test_a_worker_that_lived_through_losing_its_claims_clears_their_failure_marks():
    """A stalled worker comes back to find its claims taken: its attempts did not die with
    it, so their failure marks go (a job at its failure limit waits for exactly that:
    `worker.poison_grace_s`); a job whose terminal event it published keeps its own end."""
    table = held_jobs()
    claims = Claims(lambda: None)
    leases = ClaimLeases(table, claims, Metrics(), lease_ms=30, host=Host())

    async def main():
        table.drain()  # "finished" has its terminal event numbered: not lost
        leases.hand_back_lost(["finished", "running"])
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert claims.released == [("running", "tok", 1)]
