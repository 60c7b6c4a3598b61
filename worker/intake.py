"""Kafka job intake: the priority topics as one consumer group; fetch, decode, buffer by
priority, hand jobs to the worker as slots free; rebalance, commits, lag.

Priority: fetched records wait in one small buffer per priority class. When slots free,
they are filled from the high buffer first, then normal, then low, right after a
non-blocking fetch of whatever the consumer has prefetched, so a freed slot goes to the
highest-priority job available anywhere in this worker's assignment. A priority's
partitions are paused only while its own buffer is full (the consumer keeps calling
`getmany`, so heartbeats and `max_poll_interval_ms` never lapse); high records keep
flowing while low ones wait in Kafka. Buffered records are not claimed: after a crash
or rebalance they are simply read again from the committed offset.

Commits follow OffsetTracker (lowest unfinished offset per partition); commits for
partitions no longer owned fail and are not retried. Partitions whose committed offset
is below the log start (records deleted by retention) or absent are positioned at the
log start, which is then committed, so lag and the group's own view are true.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from schemas import keys
from schemas.codec import decode_job, recover_job_id
from schemas.wire import Job
from worker import transient_log
from worker.access import is_fatal_kafka
from worker.config import KafkaConfig
from worker.kafka_security import kafka_security_kwargs
from worker.offsets import OffsetTracker

if TYPE_CHECKING:
    from aiokafka.structs import ConsumerRecord

    from worker.metrics import Metrics

log = structlog.get_logger(__name__)


@dataclass(slots=True, eq=False)
class JobRecord:
    """A decoded job record with where it came from. `enqueue_time` is the record's
    Kafka timestamp (Unix seconds); `raw`/`key` the original bytes (for the DLQ).
    A record that is not a valid job has `job` None and the decode `error`."""

    job: Job | None
    priority: str
    tp: TopicPartition
    offset: int
    enqueue_time: float
    raw: bytes
    key: bytes | None
    error: str | None = None


class JobSink(Protocol):
    """What the intake needs from the worker."""

    def free_slots(self) -> int:
        """Jobs the worker can take now (0 while draining or while Redis is down)."""

    async def take(self, records: list[JobRecord]) -> list[JobRecord]:
        """Claim and start a batch; returns the records whose job another worker holds
        (retried later; their offsets stay open)."""

    async def reject_invalid(self, rec: JobRecord, job_id: str | None) -> None:
        """A record that does not decode as a job: DLQ (+ `finished(rejected)`), offset done."""


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    async def on_partitions_revoked(self, revoked) -> None:
        intake = self.intake
        await intake.commit(only=set(revoked))
        revoked = set(revoked)
        for buf in intake.buffers.values():  # never taken: read again by whoever owns them next
            kept = [r for r in buf if r.tp not in revoked]
            buf.clear()
            buf.extend(kept)
        for tp in revoked:
            intake.buffered_last.pop(tp, None)
        if revoked:
            intake.num_revocations += 1
            if intake.metrics is not None:
                intake.metrics.rebalances.inc()
            log.info("partitions revoked", partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        # Forget only the partitions that went elsewhere. For partitions kept, the tracker
        # still knows which offsets run here, so their re-read (from the committed offset)
        # neither runs a job twice nor lets a commit pass a job still running.
        intake = self.intake
        kept = set(assigned)
        tracker = intake.tracker
        for tp in tracker.partitions():
            if tp not in kept:
                tracker.drop(tp)
        intake.contested = [c for c in intake.contested if c.tp in kept]
        try:
            await intake.position(list(assigned))
        except (KafkaError, IllegalStateError) as e:
            level, fields = transient_log.observe_error(e)
            log.log(level, "could not position assigned partitions; leaving it to the consumer", error=repr(e),
                    **fields)
        if assigned:
            log.info("partitions assigned", partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))


class Intake:
    """Args:
    cfg: the `kafka` config section.
    client_id: this worker's id (Kafka client id).
    sink: the worker (free slots, take, reject invalid).
    tracker: the per-partition commit points (shared with the worker, which marks done).
    buffer_per_priority: fetched-but-unstarted records kept per priority class.
    metrics: optional.
    """

    def __init__(self, cfg: KafkaConfig, client_id: str, sink: JobSink, tracker: OffsetTracker[TopicPartition], *,
                 buffer_per_priority: int, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.client_id = client_id
        self.sink = sink
        self.tracker = tracker
        self.metrics = metrics
        self.topics = {keys.job_topic(cfg.topic_prefix, p): p for p in keys.PRIORITIES}
        self.buffer_cap = max(1, buffer_per_priority)
        self.buffers: dict[str, deque[JobRecord]] = {p: deque() for p in keys.PRIORITIES}
        self.buffered_last: dict[TopicPartition, int] = {}  # highest offset in a buffer, per partition
        self.consumer = self._make_consumer()
        self.contested: list[JobRecord] = []
        self.log_start: dict[TopicPartition, int] = {}
        self.paused_priorities: set[str] = set()
        self.num_revocations = 0
        self.num_consumer_restarts = 0
        self.num_invalid = 0
        self._last_commit = 0.0
        self._last_contested = 0.0
        self._last_progress = time.monotonic()
        self._last_stall_check = 0.0

    def _make_consumer(self) -> AIOKafkaConsumer:
        cfg = self.cfg
        return AIOKafkaConsumer(
            *self.topics,
            bootstrap_servers=cfg.bootstrap_servers,
            group_id=cfg.group_id,
            client_id=self.client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            max_poll_interval_ms=cfg.max_poll_interval_ms,
            max_partition_fetch_bytes=cfg.max_partition_fetch_bytes,
            fetch_max_bytes=max(cfg.max_partition_fetch_bytes * 2, 52428800),
            **kafka_security_kwargs(cfg),
        )

    async def start(self) -> None:
        self.consumer.subscribe(list(self.topics), listener=_Rebalance(self))
        await self.consumer.start()
        self._last_progress = time.monotonic()

    async def stop(self) -> None:
        await self.commit()
        await self.consumer.stop()  # leaves the group: partitions go to other workers now

    @property
    def num_buffered(self) -> int:
        return sum(len(b) for b in self.buffers.values())

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
                level, fields = transient_log.observe_error(e)
                log.log(level, "Kafka error in the consume loop; retrying", error=repr(e), **fields)
                await asyncio.sleep(0.5)

    async def _iteration(self) -> None:
        self._update_pauses()
        free = self.sink.free_slots()
        busy = any(self.buffers.values()) or free > 0
        got = await self.consumer.getmany(timeout_ms=10 if busy else 100)
        self._buffer(got)
        if got or self.num_buffered or self.sink.free_slots() <= 0:
            self._last_progress = time.monotonic()
        else:
            await self._check_stall()
        await self._fill_slots()
        now = time.monotonic()
        if self.contested and now - self._last_contested > 0.5:
            self._last_contested = now
            self.contested = await self.sink.take(self.contested)
        if now - self._last_commit > self.cfg.commit_interval_ms / 1000:
            await self.commit()

    def _update_pauses(self) -> None:
        """Pause a priority's partitions while its buffer is full; resume when it has room."""
        assigned = self.consumer.assignment()
        full = {p for p, b in self.buffers.items() if len(b) >= self.buffer_cap}
        if full == self.paused_priorities:
            return
        pause = [tp for tp in assigned if self.topics.get(tp.topic) in full]
        resume = [tp for tp in assigned if self.topics.get(tp.topic) not in full]
        if pause:
            self.consumer.pause(*pause)
        if resume:
            self.consumer.resume(*resume)
        self.paused_priorities = full

    def _buffer(self, got: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        """Decode fetched records into the priority buffers. A record is *taken* (enters
        the OffsetTracker) only when it leaves its buffer, in offset order per partition,
        so records dropped from a buffer by a rebalance are simply read again."""
        assigned = self.consumer.assignment()
        for tp, recs in got.items():
            prio = self.topics[tp.topic]
            for rec in recs:
                seen = max(self.tracker.last_taken(tp), self.buffered_last.get(tp, -1))
                if tp not in assigned or rec.offset <= seen:
                    continue  # not ours any more, or already here (re-read after a rebalance)
                self.buffered_last[tp] = rec.offset
                value = rec.value or b""
                try:
                    job, error = decode_job(value), None
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    job, error = None, str(e)
                self.buffers[prio].append(
                    JobRecord(job, prio, tp, rec.offset, rec.timestamp / 1000.0, value, rec.key, error))

    async def _fill_slots(self) -> None:
        """Free slots take buffered jobs, highest priority first, after a non-blocking
        fetch of what is prefetched. Invalid records need no slot: they go to the DLQ
        when they reach the head of their buffer (records leave in offset order)."""
        if not any(self.buffers.values()):
            return
        free = self.sink.free_slots()
        if free > 0:
            self._buffer(await self.consumer.getmany(timeout_ms=0))
        batch: list[JobRecord] = []
        invalid: list[JobRecord] = []
        assigned = self.consumer.assignment()
        for prio in keys.PRIORITIES:
            buf = self.buffers[prio]
            while buf and (buf[0].job is None or len(batch) < free):
                rec = buf.popleft()
                if rec.tp not in assigned or not self.tracker.add(rec.tp, rec.offset):
                    continue
                (batch if rec.job is not None else invalid).append(rec)
        for rec in invalid:
            self.num_invalid += 1
            await self.sink.reject_invalid(rec, recover_job_id(rec.raw))
        if not batch:
            return
        contested = await self.sink.take(batch)
        assigned = self.consumer.assignment()  # a rebalance may have happened meanwhile
        self.contested.extend(c for c in contested if c.tp in assigned)

    async def _check_stall(self) -> None:
        """Watchdog: partitions have unread records, this worker has free slots, yet no
        record came for `kafka.stall_timeout_s`. aiokafka has been seen to stop fetching
        after a group member died (all assigned partitions silent, no error); the remedy
        is a fresh consumer. Unread is measured from the log start, so records deleted
        by retention never look like a stall."""
        now = time.monotonic()
        stall_s = self.cfg.stall_timeout_s
        if now - self._last_progress < stall_s or now - self._last_stall_check < stall_s / 2:
            return
        self._last_stall_check = now
        assigned = list(self.consumer.assignment())
        if not assigned:
            return
        try:
            ends = await asyncio.wait_for(self.consumer.end_offsets(assigned), 10)
            starts = await asyncio.wait_for(self.consumer.beginning_offsets(assigned), 10)
            committed = await asyncio.wait_for(
                asyncio.gather(*(self.consumer.committed(tp) for tp in assigned)), 10)
        except (TimeoutError, KafkaError, IllegalStateError) as e:
            # The broker does not answer: that is an outage (readiness reports it), not a
            # stalled consumer; a fresh consumer would not fetch either. Check again later.
            # Quiet while it may be a broker restart (kafka.transient_grace_s).
            level, fields = transient_log.observe("broker_unreachable")
            log.log(level, "stall check could not reach Kafka; not recreating the consumer", error=repr(e), **fields)
            return
        self.log_start.update(starts)
        lagging = [tp for tp, c in zip(assigned, committed)
                   if ends[tp] > max(c or 0, starts[tp], self.tracker.last_taken(tp) + 1)]
        if not lagging:
            self._last_progress = now
            return
        log.warning("consumer stalled: partitions have unread jobs but nothing was fetched; recreating it",
                    stalled_s=round(now - self._last_progress, 1),
                    partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in lagging))
        self.num_consumer_restarts += 1
        if self.metrics is not None:
            self.metrics.consumer_restarts.inc()
        old = self.consumer
        try:
            await asyncio.wait_for(old.stop(), 15)  # commits via the revoke callback, leaves the group
        except Exception as e:  # a wedged consumer: abandon it
            log.warning("stalled consumer did not stop cleanly", error=repr(e))
        self.consumer = self._make_consumer()
        self.paused_priorities = set()
        self.consumer.subscribe(list(self.topics), listener=_Rebalance(self))
        await self.consumer.start()
        self._last_progress = time.monotonic()

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
