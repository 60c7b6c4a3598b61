"""Kafka job intake: the priority topics as one consumer group; fetch, decode, read
ahead, hand jobs to the worker as slots free; rebalance, commits, lag.

Read-ahead and choice: fetched records wait in the ReadAhead (read_ahead.py: which of
them free slots take, by priority class first and tenant share inside a class), up to
`worker.read_ahead_per_partition` per partition. Only as many records as fit are taken
out of the consumer (`getmany` per partition with `max_records`); the rest stay in its
own fetch buffer, so nothing fetched is decoded and thrown away (only the byte bound can
still be passed: the partition is then sought back to the first record not kept).
Partitions are paused only while the read-ahead holds its byte bound (the consumer keeps
calling `getmany`, so heartbeats and `max_poll_interval_ms` never lapse). Invalid
records need no slot: they go to the DLQ when read.

Offsets: a record is registered in the OffsetTracker when it is *read*, so taking
records out of offset order never lets the commit point (lowest unfinished offset per
partition) pass one still waiting here: a crash re-reads it. Read-ahead records are not
claimed. On a rebalance (aiokafka's is eager: every partition is revoked, then some are
assigned again) the revoke commits and keeps everything; the assignment then forgets,
in the tracker and the read-ahead, only the partitions that went elsewhere. A kept
partition is re-read from its committed offset, and the tracker refuses every record
it already knows (read, running or finished), so nothing runs twice and nothing read
is lost. Nothing is taken between the revoke and the assignment.

Commits for partitions no longer owned fail and are not retried. Partitions whose
committed offset is below the log start (records deleted by retention) or absent are
positioned at the log start, which is then committed, so lag and the group's own view
are true. A consumer that stops fetching is replaced (stall.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.errors import CommitFailedError, IllegalStateError, InconsistentGroupProtocolError, KafkaError

from schemas import keys
from schemas.codec import decode_job, recover_job_id
from worker.config import ConfigError, KafkaConfig
from worker.obs import transient_log
from worker.security.access import is_fatal_kafka
from worker.security.kafka import kafka_security_kwargs, stop_client
from worker.serve.offsets import OffsetTracker
from worker.serve.read_ahead import JobRecord, ReadAhead, TenantGate
from worker.serve.rebalance import Rebalance
from worker.serve.stall import StallWatchdog
from worker.serve.sticky import StickyAssignor

if TYPE_CHECKING:
    from aiokafka.structs import ConsumerRecord

    from worker.obs.metrics import Metrics
    from worker.serve.fleet_quota import FleetQuota
    from worker.serve.kafka_outage import KafkaOutage

log = structlog.get_logger(__name__)

# The error of a record whose value is null: dead-lettered as `invalid_job` with its key
# and a null value (the original, untouched), like every record that is not a job.
NULL_VALUE_ERROR = "the record's value is null (a Kafka tombstone produced to a job topic): not a job"


class JobSink(Protocol):
    """What the intake needs from the worker."""

    def free_slots(self) -> int:
        """Jobs the worker can take now (0 while draining or while Redis is down)."""

    def held_by_tenant(self) -> Mapping[str, int]:
        """Jobs not yet at their terminal event, per tenant (tenants with none may be absent)."""

    async def take(self, records: list[JobRecord]) -> list[JobRecord]:
        """Claim and start a batch; returns the records whose job another worker holds
        (retried later; their offsets stay open)."""

    async def reject_invalid(self, rec: JobRecord, job_id: str | None) -> None:
        """A record that does not decode as a job: DLQ (+ `finished(rejected)`), offset done
        (both by the finalizer)."""


class ContestedCounted:
    """The fleet limits' gate (`TenantGate`) with the records contested here counted as
    held (`Intake.contested_by_tenant`): a new record of a tenant is not admitted into
    the slots those would take when their holders let them go."""

    def __init__(self, quota: TenantGate, contested: Mapping[str, int]) -> None:
        self.quota = quota
        self.contested = contested

    def blocked(self, tenant: str, held: int) -> str | None:
        return self.quota.blocked(tenant, held + self.contested.get(tenant, 0))

    def charge(self, rec: JobRecord) -> None:
        self.quota.charge(rec)


class Intake:
    """The job consumer: fetches, decodes, reads ahead, hands records to free slots by priority and tenant share, commits.

    Args:
        cfg: the `kafka` config section.
        client_id: this worker's id (Kafka client id).
        sink: the worker (free slots, jobs held per tenant, take, reject invalid).
        tracker: the per-partition commit points: the intake registers reads and commits;
            the finalizer (finalize.py) marks records done.
        read_ahead_per_partition, read_ahead_bytes: bounds of the read-ahead.
        tenant_weight: a tenant's weight (`serving_tuning.tenants`), for the choice.
        tenant_cap: the most local jobs a tenant may hold.
        high_priority_reserve: free slots lower classes leave to high-priority jobs.
        fair: choose by tenant share inside a class (`serving_tuning.fair_share`); else by
            read order.
        metrics: optional.
        outage: where transient Kafka errors of the consume loop are reported (optional).
        pool, group_id: the pool whose job topics are read (schemas/pools.py; None: the
            default pool's) and its consumer group (None: `cfg.group_id`).
        quota: the fleet-wide tenant limits (fleet_quota.py), None when no tenant has one.
    """

    def __init__(self, cfg: KafkaConfig, client_id: str, sink: JobSink, tracker: OffsetTracker[TopicPartition], *,
                 read_ahead_per_partition: int, read_ahead_bytes: int,
                 tenant_weight: Callable[[str], float] = lambda t: 1.0,
                 tenant_cap: Callable[[str], int] = lambda t: 1 << 30, fair: bool = True,
                 high_priority_reserve: int = 0, metrics: Metrics | None = None,
                 outage: KafkaOutage | None = None, pool: str | None = None, group_id: str | None = None,
                 quota: FleetQuota | None = None) -> None:
        self.outage = outage
        self.quota = quota
        self.high_priority_reserve = high_priority_reserve
        self.cfg = cfg
        self.client_id = client_id
        self.sink = sink
        self.tracker = tracker
        self.metrics = metrics
        self.topics = {keys.job_topic(cfg.topic_prefix, p, pool): p for p in keys.PRIORITIES}
        self.group_id = group_id or cfg.group_id
        self.read_ahead = ReadAhead(read_ahead_per_partition, read_ahead_bytes, fair)
        self.tenant_weight = tenant_weight
        self.tenant_cap = tenant_cap
        self.invalid: list[JobRecord] = []  # read, not jobs: to the DLQ
        self.assignor = StickyAssignor()  # kept across a recreated consumer: its claims go on (sticky.py)
        self.consumer = self._make_consumer()
        self._contested: list[JobRecord] = []
        self.log_start: dict[TopicPartition, int] = {}
        self.paused: set[TopicPartition] = set()
        self.rebalancing = False  # between a revoke and the next assignment: take nothing
        self.num_revocations = 0
        self.num_consumer_restarts = 0
        self.num_invalid = 0
        self._last_commit = 0.0
        self._last_contested = 0.0
        self.watchdog = StallWatchdog(cfg.stall_timeout_s)

    def _make_consumer(self) -> AIOKafkaConsumer:
        cfg = self.cfg
        return AIOKafkaConsumer(
            *self.topics,
            bootstrap_servers=cfg.bootstrap_servers,
            group_id=self.group_id,
            client_id=self.client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            max_poll_interval_ms=cfg.max_poll_interval_ms,
            max_partition_fetch_bytes=cfg.max_partition_fetch_bytes,
            fetch_max_bytes=max(cfg.max_partition_fetch_bytes * 2, 52428800),
            partition_assignment_strategy=(self.assignor.strategy() if cfg.partition_assignor == "sticky"
                                           else (RoundRobinPartitionAssignor,)),
            **kafka_security_kwargs(cfg),
        )

    async def start(self) -> None:
        """Join the group and start fetching.

        Raises:
            ConfigError: the group's members agreed on another assignor
                (`kafka.partition_assignor`; worker/serve/sticky.py).
        """
        self.consumer.subscribe(list(self.topics), listener=Rebalance(self))
        await self._start_consumer()
        self.watchdog.progress()

    async def _start_consumer(self) -> None:
        try:
            await self.consumer.start()
        except InconsistentGroupProtocolError:
            await stop_client(self.consumer, "intake")
            other = "roundrobin" if self.cfg.partition_assignor == "sticky" else "sticky"
            raise ConfigError(
                f"kafka.partition_assignor is {self.cfg.partition_assignor!r} but the members of consumer group "
                f"{self.group_id!r} agreed on another assignor (likely {other!r}: workers from before, or set "
                f"so); set kafka.partition_assignor: {other} here, or restart every worker of the group at once "
                "with the same value") from None

    async def stop(self) -> None:
        await self.commit()
        await stop_client(self.consumer, "intake")  # leaves the group: partitions go to other workers now

    def keep_only(self, kept: set[TopicPartition]) -> None:
        """A new assignment: forget, in the tracker, the read-ahead and the waiting lists,
        the partitions that went elsewhere; a new assignment starts unpaused."""
        for tp in self.tracker.partitions():
            if tp not in kept:
                self.tracker.drop(tp)
        self.read_ahead.drop(lambda tp: tp in kept)
        self.invalid = [r for r in self.invalid if r.tp in kept]
        if self.quota is not None:  # contested records charged when first taken, never run here
            for c in self._contested:
                if c.tp not in kept:
                    self.quota.refund(c)
        self._contested = [c for c in self._contested if c.tp in kept]
        self.paused = set()

    @property
    def num_buffered(self) -> int:
        return len(self.read_ahead) + len(self.invalid)

    # ---- positions and lag -----------------------------------------------------------
    async def position(self, tps: list[TopicPartition]) -> None:
        """Seek each partition to its committed offset, or to the log start when the
        committed offset is absent or below it (records deleted by retention); in that
        case the log start becomes the partition's commit point."""
        if not tps:
            return
        consumer = self.consumer
        committed = {tp: await consumer.committed(tp) for tp in tps}
        starts = await consumer.beginning_offsets(tps)
        self.log_start.update(starts)
        for tp in tps:
            c = committed[tp]
            start = starts[tp]
            if c is None or c < start:
                consumer.seek(tp, start)
                self.tracker.mark_committed(tp, -1 if c is None else c)
                self.tracker.skip_to(tp, start)  # committed by the next commit()
            else:
                consumer.seek(tp, c)
                self.tracker.mark_committed(tp, c)

    def lag(self, end_offsets: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Consumer lag per partition: log end offset minus the group's position, where
        the position is the committed offset or, if that is below the log start (or
        absent), the log start (what a consumer can still read)."""
        lags = {}
        for tp, end in end_offsets.items():
            committed = self.tracker.committed(tp)
            base = max(committed if committed is not None else -1, self.log_start.get(tp, 0))
            lags[tp] = max(0, end - base)
        return lags

    # ---- the consume loop ------------------------------------------------------------
    async def run(self, stopping: asyncio.Event) -> None:
        """Consume until `stopping`. Broker errors back off and retry; authorization and
        authentication errors (`access.is_fatal_kafka`) and anything else propagate (the
        worker stops and its jobs are redelivered)."""
        while not stopping.is_set():
            try:
                await self._iteration()
            except (KafkaError, IllegalStateError) as e:
                if is_fatal_kafka(e):  # a missing ACL or refused credentials: retrying cannot help
                    raise
                if self.outage is not None:
                    self.outage.failed("intake", e)
                level, fields = transient_log.observe_error(e)
                log.log(level, "Kafka error in the consume loop; retrying", error=repr(e), **fields)
                await asyncio.sleep(0.5)
                continue
            if self.outage is not None:
                self.outage.ok("intake")

    async def _iteration(self) -> None:
        self._update_pauses()
        free = self.sink.free_slots()
        busy = self.num_buffered > 0 or free > 0
        with_room, least_room = self._with_room()
        if with_room:  # wait for records of those partitions; no more than any of them can keep
            got = await self.consumer.getmany(*with_room, timeout_ms=10 if busy else 100, max_records=least_room)
        else:  # every partition is paused (see _update_pauses): a poll that returns nothing
            got = await self.consumer.getmany(timeout_ms=10 if busy else 100)
        self._buffer(got)
        if got:
            await self._fetch_prefetched()
        if got or self.num_buffered or self.sink.free_slots() <= 0:
            self.watchdog.progress()
        else:
            await self._check_stall()
        await self._fill_slots()
        now = time.monotonic()
        if self._contested and now - self._last_contested > 0.5:
            self._last_contested = now
            self._contested = await self.sink.take(self._contested)
        if now - self._last_commit > self.cfg.commit_interval_ms / 1000:
            await self.commit()

    def _update_pauses(self) -> None:
        """Pause every partition while the read-ahead holds `read_ahead_bytes` or all are
        full; resume them all when there is room. A full partition among others with room
        is only left out of the fetch (`_with_room`; its records stay in the consumer's
        buffer, one fetch response at most). Pausing each full partition on its own made
        the consumer fetch and decode again after each resume: 4-token jobs at 256
        running waited 200-400 ms with nothing to run on every refill."""
        assigned = self.consumer.assignment()
        ra = self.read_ahead
        saturated = ra.num_bytes >= ra.max_bytes or not any(ra.room(tp) for tp in assigned)
        full = set(assigned) if saturated else set()
        if full == self.paused:
            return
        pause = full - self.paused
        resume = (self.paused - full) & assigned
        if pause:
            self.consumer.pause(*pause)
        if resume:
            self.consumer.resume(*resume)
        self.paused = full

    def _with_room(self) -> tuple[list[TopicPartition], int]:
        """The partitions not paused whose read-ahead has room, and the least of their
        rooms (a waiting fetch may return all its records from one partition)."""
        ra = self.read_ahead
        rooms = [(tp, n) for tp in self.consumer.assignment() if tp not in self.paused and (n := ra.room(tp)) > 0]
        return [tp for tp, _ in rooms], min((n for _, n in rooms), default=0)

    async def _fetch_prefetched(self) -> None:
        """What the consumer has already fetched, without waiting: per partition at most
        what its read-ahead has room for (the rest stays in the consumer's buffer; taking
        it all and seeking back would decode it again on the next fetch)."""
        ra = self.read_ahead
        for tp in self.consumer.assignment():
            room = ra.room(tp)
            if room > 0 and tp not in self.paused:
                self._buffer(await self.consumer.getmany(tp, timeout_ms=0, max_records=room))

    def _buffer(self, got: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        """Decode fetched records into the read-ahead (invalid ones aside for the DLQ).
        Each is registered in the tracker here, when read, which also refuses records
        already read (a re-read after a rebalance that kept the partition). Records
        beyond the read-ahead's bound are not kept: the partition is sought back to the
        first of them, to be read again when there is room."""
        assigned = self.consumer.assignment()
        tracker = self.tracker
        read_ahead = self.read_ahead
        now = time.time()
        for tp, recs in got.items():
            prio = self.topics[tp.topic]
            for rec in recs:
                if tp not in assigned or rec.offset <= tracker.last_read(tp):
                    continue  # not ours any more, or already read here
                if not read_ahead.has_room(tp):
                    self.consumer.seek(tp, rec.offset)
                    break
                tracker.read(tp, rec.offset)
                value = rec.value  # None: a null value (a Kafka tombstone produced to a job topic)
                if value is None:
                    job, error = None, NULL_VALUE_ERROR
                else:
                    try:
                        job, error = decode_job(value), None
                    except (msgspec.DecodeError, msgspec.ValidationError) as e:
                        job, error = None, str(e)
                jr = JobRecord(job, prio, tp, rec.offset, rec.timestamp / 1000.0, value, rec.key, error,
                               headers=rec.headers, read_time=now)
                (read_ahead.add if job is not None else self.invalid.append)(jr)

    async def _fill_slots(self) -> None:
        """Invalid records go to the DLQ (they need no slot); free slots take records from
        the read-ahead (by priority, then tenant share), after a non-blocking fetch of
        what is prefetched. Nothing is taken while a rebalance is under way."""
        if self.rebalancing:
            return
        while self.invalid:
            rec = self.invalid[0]  # removed once dead-lettered: a Kafka error here retries it, never loses it
            await self.sink.reject_invalid(rec, recover_job_id(rec.raw or b"", rec.key))
            if self.invalid and self.invalid[0] is rec:
                self.invalid.pop(0)
            self.num_invalid += 1
        if not self.read_ahead:
            return
        free = self.sink.free_slots()
        if free <= 0:
            return
        await self._fetch_prefetched()
        quota = self.quota
        if quota is not None and self._contested:  # admitted once; they run here once their holder lets go
            quota = ContestedCounted(quota, self.contested_by_tenant())
        batch = self.read_ahead.take(free, self.sink.held_by_tenant(), self.tenant_weight, self.tenant_cap,
                                     self.high_priority_reserve, quota)
        if self.metrics is not None:
            for why in self.read_ahead.passed_over.values():
                self.metrics.quota.denials.labels(why).inc()
        if not batch:
            return
        self.add_contested(await self.sink.take(batch))

    def contested_by_tenant(self) -> Counter[str]:
        """Contested records per tenant. Each was admitted and charged when first taken,
        and runs here with no new admission once its job's holder lets it go, so the
        fleet's slot reservations count it as held here (`fleet_quota.py`)."""
        return Counter(rec.tenant for rec in self._contested)

    def add_contested(self, records: list[JobRecord]) -> None:
        """Records whose job another worker holds now (its claim, or a lost one's): taken
        again every 0.5 s while their partition stays assigned here, their offsets open
        until then. The intake is the only writer of this list."""
        assigned = self.consumer.assignment()  # a rebalance may have happened meanwhile
        self._contested.extend(c for c in records if c.tp in assigned)

    async def _check_stall(self) -> None:
        """Recreate the consumer when the watchdog (stall.py) finds it stalled."""
        lagging = await self.watchdog.stalled(self.consumer, self.tracker, self.log_start)
        if not lagging:
            return
        log.warning("consumer stalled: partitions have unread jobs but nothing was fetched; recreating it",
                    stalled_s=round(self.watchdog.stalled_s, 1),
                    partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in lagging))
        self.num_consumer_restarts += 1
        if self.metrics is not None:
            self.metrics.consumer_restarts.inc()
        await stop_client(self.consumer, "stalled consumer")  # commits via the revoke callback, leaves the group
        self.consumer = self._make_consumer()
        self.paused = set()
        self.consumer.subscribe(list(self.topics), listener=Rebalance(self))
        await self._start_consumer()
        self.watchdog.progress()

    # ---- commits -----------------------------------------------------------------------
    async def commit(self, only: set[TopicPartition] | None = None) -> None:
        self._last_commit = time.monotonic()
        tracker = self.tracker
        assigned = self.consumer.assignment()
        points = {tp: off for tp, off in tracker.commit_points().items()
                  if tp in assigned and (only is None or tp in only)}
        if not points:
            return
        try:
            await self.consumer.commit(points)
        except (CommitFailedError, IllegalStateError, KafkaError) as e:
            # Typically: partitions no longer ours after a rebalance. Not retried; the new
            # owner re-reads from the last committed offset and skips finished jobs.
            log.warning("offset commit failed", error=repr(e), partitions=len(points))
            if self.metrics is not None:
                self.metrics.commit_failures.inc()
            return
        for tp, off in points.items():
            tracker.mark_committed(tp, off)
