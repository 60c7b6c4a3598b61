"""What a worker's fleet slot reservations cover (`fleet_max_running`, fleet_quota.py):
every record charged at the intake counts as held until it is refunded or ends, whether
the job table holds it, the starter is claiming it, or another worker holds its job
(contested). The fault behind it: a sync round between the take and the open saw the
tenant hold fewer jobs than it was about to, gave the slots away, and three workers
held 3 jobs of a tenant capped at 2 (tests/integration/test_fleet_quota.py, in CI); a
contested record, admitted once, runs with no new admission when its holder dies."""

from __future__ import annotations

import asyncio
from unittest.mock import MagicMock

from aiokafka import TopicPartition

from schemas.wire import Job
from worker.serve.claims import Claimed, Contested
from worker.serve.intake import ContestedCounted
from worker.serve.jobs import JobTable
from worker.serve.read_ahead import JobRecord
from worker.serve.starter import JobStarter


def record(job_id: str, tenant: str, offset: int) -> JobRecord:
    return JobRecord(Job(job_id=job_id, prompt_token_ids=[1, 2, 3], tenant=tenant), "normal", TopicPartition("t", 0), offset, 100.0,
                     None, None)


class HeldClaims:
    """Claims answered only once `answer` is set; the first job claimed, the rest contested."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()

    async def take(self, refs):
        await self.answer.wait()
        return [Claimed("token", 1, 0, 0, False)] + [Contested(False) for _ in refs[1:]]


def test_records_are_counted_while_their_claims_are_in_flight_and_once_opened_by_the_table():
    async def main():
        table = JobTable("w1")
        claims = HeldClaims()
        engine = MagicMock()
        engine.tuning.max_input_tokens = None
        cancels = MagicMock()
        cancels.is_cancelled.return_value = False
        starter = JobStarter(table, claims, engine, MagicMock(), MagicMock(), MagicMock(), cancels,
                             max_local_jobs=8, max_job_failures=2)
        task = asyncio.create_task(starter.take([record("c-1", "C", 1), record("c-2", "C", 2),
                                                 record("b-1", "B", 3)]))
        await asyncio.sleep(0.01)  # the claim round trip is in flight
        during = (starter.holding_by_tenant(), dict(table.held_by_tenant()))
        claims.answer.set()
        contested = await task
        after = (starter.holding_by_tenant(), dict(table.held_by_tenant()))
        starter.close()
        return during, contested, after

    during, contested, after = asyncio.run(main())
    assert during == ({"C": 2, "B": 1}, {})
    assert [r.job.job_id for r in contested] == ["c-2", "b-1"]  # back to the intake, not held here
    assert after == ({"C": 1}, {"C": 1})


def test_a_tenant_is_not_admitted_into_the_slots_its_contested_records_would_take():
    class Gate:  # a fleet gate of two slots for C
        charged: list[str] = []

        def blocked(self, tenant: str, held: int) -> str | None:
            return "fleet_running" if tenant == "C" and held >= 2 else None

        def charge(self, rec) -> None:
            self.charged.append(rec.job.job_id)

    gate = ContestedCounted(Gate(), {"C": 1})
    assert gate.blocked("C", 0) is None and gate.blocked("C", 1) == "fleet_running"
    assert gate.blocked("B", 5) is None
    gate.charge(record("c-3", "C", 4))
    assert Gate.charged == ["c-3"]
