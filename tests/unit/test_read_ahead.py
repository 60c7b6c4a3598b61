"""The intake's read-ahead and its offset bookkeeping: records are chosen by priority,
then tenant share, out of offset order; the commit point never passes a record read
ahead; an eager rebalance (revoke all, assign some) loses nothing and runs nothing
twice. The consumer is a fake with Kafka's semantics (positions, pause, seek, commit),
so every rule of worker/serve/intake.py runs without a broker (tests/integration has the real one)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from aiokafka import TopicPartition
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import encode
from schemas.wire import Job
from worker.config import KafkaConfig, ServingTuning, TenantPolicy, WorkerSettings
from worker.serve.intake import Intake
from worker.serve.offsets import OffsetTracker
from worker.serve.read_ahead import JobRecord, ReadAhead, high_priority_reserve, local_shares
from worker.serve.rebalance import Rebalance

NORMAL = TopicPartition("t.jobs.normal", 0)


def rec(tenant: str | None, offset: int, prio: str = "normal", tp=NORMAL, size: int = 10) -> JobRecord:
    job = Job(job_id=f"{tenant}-{tp.partition}-{offset}", prompt="x" * size, tenant=tenant)
    return JobRecord(job, prio, tp, offset, float(offset), b"x" * size, None)


def one(weight: float = 1.0):
    return lambda t: weight


def caps(n: int):
    return lambda t: n


def test_take_orders_priority_then_tenant_share_then_read_order():
    ra = ReadAhead(per_partition=100, max_bytes=10**6)
    for o in range(10):
        ra.add(rec("A", o))  # a flood read first
    ra.add(rec("B", 10))
    ra.add(rec("B", 11))
    ra.add(rec("C", 12, prio="low"))
    ra.add(rec("D", 13, prio="high"))
    got = ra.take(5, {"A": 4}, one(), caps(100))
    # high first; then B (holds 0) and A (holds 4) by local jobs held: B, B, then A ...
    assert [(r.tenant, r.offset) for r in got] == [("D", 13), ("B", 10), ("B", 11), ("A", 0), ("A", 1)]
    assert len(ra) == 9 and ra.num_bytes == 90


def test_weights_and_caps_shape_the_choice():
    ra = ReadAhead(per_partition=100, max_bytes=10**6)
    for o in range(20):
        ra.add(rec("A" if o % 2 else "B", o))
    ra.add(rec("C", 30, prio="low"))
    weights = {"A": 3.0, "B": 1.0}
    got = ra.take(8, {}, lambda t: weights.get(t, 1.0), lambda t: 5 if t == "A" else 2)
    counts = Counter(r.tenant for r in got)
    # A (weight 3) would take 3 for each of B's, but B stops at its cap of 2 and A at
    # 5; the last slot goes to the low class (C): a capped tenant does not block others
    assert counts == {"A": 5, "B": 2, "C": 1}, counts


def test_bounds_per_partition_and_past_the_byte_bound():
    p1 = TopicPartition("t.jobs.normal", 1)
    ra = ReadAhead(per_partition=3, max_bytes=100)
    for o in range(3):
        ra.add(rec("A", o))
    ra.add(rec("A", 0, tp=p1))
    assert not ra.has_room(NORMAL) and ra.has_room(p1) and ra.room(p1) == 2
    ra.add(rec("A", 1, tp=p1, size=70))
    assert not ra.has_room(p1) and not ra.has_room(TopicPartition("t.jobs.low", 0))  # 100 bytes held
    assert ra.drop(lambda tp: tp != p1) == 2 and len(ra) == 3 and ra.num_bytes == 30
    assert not ra.has_room(NORMAL) and ra.has_room(p1) and ra.room(p1) == 3


def test_local_shares_default_cap_leaves_room_for_other_tenants():
    tuning = ServingTuning(max_running_requests=4, tenants={"q": TenantPolicy(max_running_requests=1, weight=2)})
    weight, cap = local_shares(tuning, WorkerSettings(), max_local_jobs=8)
    assert (cap("any"), weight("any")) == (6, 1.0)
    assert (cap("q"), weight("q")) == (2, 2.0)  # twice its running quota
    _, cap = local_shares(tuning, WorkerSettings(max_local_jobs_per_tenant=8), max_local_jobs=8)
    assert cap("any") == 8


@pytest.mark.parametrize("running,local", [(4, None), (4, 8), (4, 12), (256, None), (8, 9), (1, None)])
def test_a_newcomer_finds_half_a_batch_of_normal_slots_beside_a_flood(running, local):
    """Regression (CI, stop 40): with the worker's defaults (max_running 4, 8 local jobs,
    a high-priority reserve of 1) the default cap let a normal-class flood hold 6 of the
    7 slots a normal job may take, so a tenant behind it held one job at a time and its
    8 short jobs ran one after another (TTFT p99 5.8x its value alone). The cap counts
    the slots left after the reserve: a flood leaves running // 2 of them (at least one)."""
    tuning = ServingTuning(max_running_requests=running)
    max_local = local or 2 * running
    reserve = high_priority_reserve(tuning, WorkerSettings(max_local_jobs=local), max_local)
    _, cap = local_shares(tuning, WorkerSettings(max_local_jobs=local), max_local, reserve)
    normal_slots = max_local - reserve
    assert normal_slots - cap("flood") >= min(max(1, running // 2), normal_slots - 1)
    assert cap("flood") >= 1


# ---- the tracker: out-of-order takes and completions ----------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_commit_point_is_the_lowest_unfinished_record_read(gaps, rnd: random.Random):
    t = OffsetTracker()
    offsets, o = [], 0
    for g in gaps:
        o += g
        offsets.append(o)
        assert t.read("p", o)
    unfinished = set(offsets)
    committed = None
    for x in rnd.sample(offsets, k=len(offsets)):  # taken and finished in any order
        t.done("p", x)
        unfinished.discard(x)
        point = t.commit_point("p")
        want = min(unfinished) if unfinished else offsets[-1] + 1
        if point is None:
            assert want == committed  # nothing new to commit
        else:
            assert point == want
            t.mark_committed("p", point)
            committed = point
        assert not any(t.read("p", y) for y in offsets)  # a re-read is refused, done or not


# ---- the intake over a fake consumer -------------------------------------------------
@dataclass
class FakeRecord:
    offset: int
    value: bytes
    key: bytes | None
    timestamp: int
    headers: tuple = ()  # as aiokafka's ConsumerRecord: [(name, value bytes)]


class FakeConsumer:
    """Partition logs, positions, pauses and committed offsets with Kafka's meaning."""

    def __init__(self, logs: dict[TopicPartition, list[bytes]]) -> None:
        self.logs = logs
        self.position: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}
        self._assigned: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self.returned: Counter = Counter()  # (tp, offset) -> times handed out by getmany

    def assignment(self):
        return set(self._assigned)

    def pause(self, *tps):
        self._paused.update(tps)

    def resume(self, *tps):
        self._paused.difference_update(tps)

    def paused(self):
        return set(self._paused)

    async def getmany(self, *partitions, timeout_ms: int = 0, max_records: int | None = None):
        """Up to 40 records per partition (a fetch may bring more than the read-ahead
        keeps), at most `max_records` in all; what is not returned stays for later."""
        out = {}
        left = max_records
        for tp in sorted(self._assigned - self._paused, key=lambda tp: tp.partition):
            if partitions and tp not in partitions:
                continue
            pos = self.position.get(tp, 0)
            n = 40 if left is None else min(40, left)
            batch = self.logs[tp][pos : pos + n]
            if batch:
                out[tp] = [FakeRecord(pos + i, v, None, 1000 * (pos + i)) for i, v in enumerate(batch)]
                self.position[tp] = pos + len(batch)
                self.returned.update((tp, r.offset) for r in out[tp])
                if left is not None:
                    left -= len(batch)
                    if left == 0:
                        break
        return out

    async def committed(self, tp):
        return self._committed.get(tp)

    async def beginning_offsets(self, tps):
        return {tp: 0 for tp in tps}

    def seek(self, tp, offset):
        self.position[tp] = offset

    async def commit(self, points):
        self._committed.update(points)

    def assign(self, tps):
        """The group coordinator's side of an eager rebalance."""
        self._assigned = set(tps)
        self._paused = set()


class FakeSink:
    """The worker: holds taken jobs per tenant up to `max_local`; finishes on request."""

    def __init__(self, tracker: OffsetTracker, max_local: int) -> None:
        self.tracker = tracker
        self.max_local = max_local
        self.held: dict[str, JobRecord] = {}
        self.taken: list[JobRecord] = []

    def free_slots(self) -> int:
        return self.max_local - len(self.held)

    def held_by_tenant(self):
        return Counter(r.tenant for r in self.held.values())


    async def take(self, records):
        for r in records:
            assert r.job.job_id not in self.held
            self.held[r.job.job_id] = r
            self.taken.append(r)
        return []

    async def reject_invalid(self, rec, job_id):
        self.tracker.done(rec.tp, rec.offset)

    def finish(self, n: int, rnd: random.Random) -> None:
        for job_id in rnd.sample(sorted(self.held), k=min(n, len(self.held))):
            r = self.held.pop(job_id)
            self.tracker.done(r.tp, r.offset)


def test_eager_rebalance_keeps_read_ahead_and_loses_or_repeats_nothing():
    """Two partitions, each a flood of A with B's records behind it. The worker reads
    ahead, takes B's records out of offset order, finishes jobs in random order; then
    an eager rebalance revokes both partitions and assigns p0 back. Fetches bring more
    records than the read-ahead keeps (the consumer hands out only what fits; a
    kept partition is re-read after the rebalance). Afterwards every record
    of p0 has been taken exactly once, commits reach the log end, the read-ahead never
    held more than its bound, and the commit point never passed a record still waiting
    in it."""
    p0, p1 = TopicPartition("t.jobs.normal", 0), TopicPartition("t.jobs.normal", 1)
    logs = {}
    for tp in (p0, p1):
        logs[tp] = [encode(Job(job_id=f"{tp.partition}-{i}", prompt="p", tenant="B" if 12 <= i < 16 else "A"))
                    for i in range(24)]
        logs[tp].insert(5, b"{not a job")  # an invalid record among them: straight to the DLQ
    consumer = FakeConsumer(logs)
    consumer.assign({p0, p1})
    tracker: OffsetTracker[TopicPartition] = OffsetTracker()
    sink = FakeSink(tracker, max_local=4)
    rnd = random.Random(7)
    intake: Intake

    def check_commit_points():
        waiting = [r for q in intake.read_ahead._queues.values() for d in q.values() for r in d]
        assert all(sum(1 for r in waiting if r.tp == tp) <= 16 for tp in (p0, p1))  # the bound holds
        for r in waiting:
            point = tracker.commit_point(r.tp)
            assert point is None or point <= r.offset, (r.tp, r.offset, point)
            assert consumer._committed.get(r.tp, 0) <= r.offset

    async def run(iterations: int):
        for _ in range(iterations):
            await intake._iteration()
            await intake.commit()
            check_commit_points()
            sink.finish(rnd.randint(0, 2), rnd)

    async def main():
        nonlocal intake
        intake = Intake(KafkaConfig(topic_prefix="t"), "w", sink, tracker, read_ahead_per_partition=16,
                        read_ahead_bytes=10**6, tenant_cap=lambda t: 3)
        await intake.consumer.stop()  # never started: the fake stands in for it
        intake.consumer = consumer
        listener = Rebalance(intake)
        await listener.on_partitions_assigned({p0, p1})
        await run(12)
        first_b = min(i for i, r in enumerate(sink.taken) if r.tenant == "B")
        assert first_b < 8, [(r.tenant, r.offset) for r in sink.taken]  # B did not wait for the flood
        assert any(r.offset < max(x.offset for x in sink.taken if x.tp == r.tp)
                   for r in intake.read_ahead._queues["normal"].get("A", []))  # taken out of order
        await listener.on_partitions_revoked({p0, p1})
        await intake._iteration()  # during the rebalance nothing is taken
        before = len(sink.taken)
        consumer.assign({p0})
        await listener.on_partitions_assigned({p0})
        assert len(sink.taken) == before and p1 not in tracker.partitions()
        for _ in range(200):
            await run(1)
            if not sink.held and not intake.read_ahead and consumer.position.get(p0) == len(logs[p0]):
                sink.finish(10, rnd)
                await intake.commit()
                break
        sink.finish(10, rnd)
        await intake.commit()

    asyncio.run(main())
    taken_p0 = Counter(r.offset for r in sink.taken if r.tp == p0)
    valid_p0 = {i for i in range(len(logs[p0])) if i != 5}
    assert set(taken_p0) == valid_p0 and all(n == 1 for n in taken_p0.values()), taken_p0
    assert consumer._committed[p0] == len(logs[p0])
    assert intake.num_invalid >= 1


def test_without_fair_share_the_choice_is_read_order():
    ra = ReadAhead(per_partition=100, max_bytes=10**6, fair=False)
    for o in range(6):
        ra.add(rec("A", o))
    ra.add(rec("B", 6))
    got = ra.take(4, {"A": 3}, one(), caps(5))
    assert [(r.tenant, r.offset) for r in got] == [("A", 0), ("A", 1), ("B", 6)]  # A capped at 5


def test_lower_classes_leave_the_reserved_slots_to_high_priority():
    from aiokafka import TopicPartition

    from schemas.wire import Job
    from worker.serve.read_ahead import JobRecord, ReadAhead

    ra = ReadAhead(per_partition=100, max_bytes=1 << 20)
    tp = TopicPartition("t", 0)
    for i in range(6):
        ra.add(JobRecord(Job(job_id=f"low-{i}", prompt="x"), "low", tp, i, 0.0, b"x", None))
    taken = ra.take(4, {}, lambda t: 1.0, lambda t: 100, reserve=2)
    assert [r.job.job_id for r in taken] == ["low-0", "low-1"]  # 2 of 4 free slots stay open
    ra.add(JobRecord(Job(job_id="high-0", prompt="x"), "high", TopicPartition("h", 0), 0, 0.0, b"x", None))
    taken = ra.take(2, {}, lambda t: 1.0, lambda t: 100, reserve=2)
    assert [r.job.job_id for r in taken] == ["high-0"]  # the reserve is the high class's


@pytest.mark.parametrize(("local", "running", "explicit", "expect"), [
    (1, 1, None, 0),  # the gateway test's worker: a reserve would leave normal jobs no slot at all
    (4, 4, None, 0),  # no slot beyond the running batch: nothing to reserve
    (4, 4, 2, 0),  # an explicit reserve is capped the same way
    (5, 4, None, 1),
    (64, 32, None, 8),
    (64, 32, 0, 0),
    (64, 32, 40, 32),  # never more than the slots beyond the batch
])
def test_the_high_priority_reserve_never_takes_the_running_batch_from_lower_classes(local, running, explicit,
                                                                                      expect):
    from worker.serve.read_ahead import high_priority_reserve

    tuning = ServingTuning(max_running_requests=running, max_batched_tokens=512)
    got = high_priority_reserve(tuning, WorkerSettings(high_priority_reserve=explicit), local)
    assert got == expect
    assert local - got >= min(local, running)  # lower classes can still fill the whole batch


def test_a_worker_with_one_local_slot_takes_normal_jobs_with_the_default_reserve():
    from worker.serve.read_ahead import high_priority_reserve

    tuning = ServingTuning(max_running_requests=1, max_batched_tokens=512)
    reserve = high_priority_reserve(tuning, WorkerSettings(max_local_jobs=1), 1)
    ra = ReadAhead(per_partition=100, max_bytes=1 << 20)
    ra.add(JobRecord(Job(job_id="normal-0", prompt="x"), "normal", TopicPartition("n", 0), 0, 0.0, b"x", None))
    assert [r.job.job_id for r in ra.take(1, {}, lambda t: 1.0, lambda t: 1, reserve=reserve)] == ["normal-0"]


def test_records_beyond_the_read_ahead_stay_in_the_consumer_and_are_handed_out_once():
    """Three partitions of 60 jobs, a read-ahead of 5 per partition, 3 slots: the intake
    takes out of the consumer only what fits, so no record is handed out twice (before,
    a fetch's excess was sought back and fetched and decoded again on every refill), and
    every job is taken exactly once."""
    tps = [TopicPartition("t.jobs.normal", p) for p in range(3)]
    logs = {tp: [encode(Job(job_id=f"{tp.partition}-{i}", prompt="p")) for i in range(60)] for tp in tps}
    consumer = FakeConsumer(logs)
    consumer.assign(set(tps))
    tracker: OffsetTracker[TopicPartition] = OffsetTracker()
    sink = FakeSink(tracker, max_local=3)
    rnd = random.Random(3)

    async def main():
        intake = Intake(KafkaConfig(topic_prefix="t"), "w", sink, tracker, read_ahead_per_partition=5,
                        read_ahead_bytes=10**6)
        await intake.consumer.stop()
        intake.consumer = consumer
        await Rebalance(intake).on_partitions_assigned(set(tps))
        for _ in range(400):
            await intake._iteration()
            assert all(intake.read_ahead.room(tp) >= 0 for tp in tps)
            sink.finish(rnd.randint(0, 3), rnd)
            if len(sink.taken) == 180:
                break

    asyncio.run(main())
    assert sorted(r.job.job_id for r in sink.taken) == sorted(f"{p}-{i}" for p in range(3) for i in range(60))
    assert set(consumer.returned.values()) == {1}, consumer.returned.most_common(3)
