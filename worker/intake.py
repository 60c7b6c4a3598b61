"""Kafka job intake: consume the priority topics as one consumer group, decode and
validate, claim in Redis, hand to the engine; backpressure and commits.

Backpressure: at most `max_local_jobs` jobs are held by this process; beyond that every
job partition is paused, so unstarted jobs stay in Kafka for other workers. The consumer
keeps calling `getmany` while paused (heartbeats and `max_poll_interval_ms` never lapse).
Free slots are filled high → normal → low. Commits follow OffsetTracker (lowest
unfinished offset per partition); commits for partitions no longer owned fail and are
not retried. On revoke, finished offsets are committed and the partitions forgotten;
jobs still running keep their claims and finish, and the new owner commits past them
once their terminal event is in Redis.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from schemas import keys
from schemas.codec import decode_job, recover_job_id
from schemas.wire import (
    DLQ_HEADER_ERROR,
    DLQ_HEADER_JOB_ID,
    DLQ_HEADER_SOURCE_OFFSET,
    DLQ_HEADER_SOURCE_PARTITION,
    DLQ_HEADER_SOURCE_TOPIC,
    DLQ_HEADER_WORKER_ID,
)
from worker import transient_log
from worker.jobs import JobRecord

if TYPE_CHECKING:
    from aiokafka.structs import ConsumerRecord

    from worker.app import Worker

log = structlog.get_logger(__name__)



def kafka_security_kwargs(cfg) -> dict:
    kw: dict = {"security_protocol": cfg.security_protocol}
    if cfg.sasl_mechanism:
        kw.update(sasl_mechanism=cfg.sasl_mechanism, sasl_plain_username=cfg.sasl_username,
                  sasl_plain_password=cfg.password())
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        import ssl

        kw["ssl_context"] = ssl.create_default_context(cafile=cfg.ssl_cafile)
    return kw


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    async def on_partitions_revoked(self, revoked) -> None:
        self.intake.generation += 1  # records fetched before this point may be stale
        await self.intake.commit(only=set(revoked))
        if revoked:
            self.intake.num_revocations += 1
            self.intake.worker.metrics.rebalances.inc()
            log.info("partitions revoked", partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        # Forget only the partitions that went elsewhere. For partitions kept, the tracker
        # still knows which offsets run here, so their re-read (from the committed offset)
        # neither runs a job twice nor lets a commit pass a job still running.
        kept = set(assigned)
        intake = self.intake
        for tp in intake.worker.tracker.partitions():
            if tp not in kept:
                intake.worker.tracker.drop(tp)
        intake.contested = [c for c in intake.contested if c.tp in kept]
        # Position every partition ourselves (committed offset, else the beginning), the
        # same point the consumer's own reset would choose, so the re-read point is explicit.
        # This was a first attempt at the silent fetch stall seen after a member died
        # (aiokafka 0.14); it did not cure it alone: `Intake._check_stall` does.
        consumer = intake.consumer
        try:
            tps = list(assigned)
            committed = {tp: await consumer.committed(tp) for tp in tps}
            missing = [tp for tp in tps if committed[tp] is None]
            beginning = await consumer.beginning_offsets(missing) if missing else {}
            for tp in tps:
                start = committed[tp] if committed[tp] is not None else beginning[tp]
                consumer.seek(tp, start)
                intake.worker.tracker.mark_committed(tp, start)
        except (KafkaError, IllegalStateError) as e:
            level, fields = transient_log.observe_error(e)
            log.log(level, "could not position assigned partitions; leaving it to the consumer", error=repr(e),
                    **fields)
        if assigned:
            log.info("partitions assigned", partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))


class Intake:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        cfg = worker.cfg.kafka
        self.topics = {keys.job_topic(cfg.topic_prefix, p): p for p in keys.PRIORITIES}
        self.dlq_topic = keys.dlq_topic(cfg.topic_prefix)
        self.consumer = self._make_consumer()
        self.producer = AIOKafkaProducer(
            bootstrap_servers=cfg.bootstrap_servers,
            client_id=f"{worker.worker_id}-dlq",
            max_request_size=cfg.max_partition_fetch_bytes + 1024 * 1024,
            acks="all",
            **kafka_security_kwargs(cfg),
        )
        self.contested: list[JobRecord] = []
        self.paused = False
        self._last_commit = 0.0
        self.num_dead_letters = 0
        self.num_revocations = 0
        self.generation = 0
        self.num_consumer_restarts = 0
        self._last_progress = time.monotonic()
        self._last_stall_check = 0.0

    def _make_consumer(self) -> AIOKafkaConsumer:
        cfg = self.worker.cfg.kafka
        return AIOKafkaConsumer(
            *self.topics,
            bootstrap_servers=cfg.bootstrap_servers,
            group_id=cfg.group_id,
            client_id=self.worker.worker_id,
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
        await self.producer.start()
        self.consumer.subscribe(list(self.topics), listener=_Rebalance(self))
        await self.consumer.start()
        self._last_progress = time.monotonic()

    async def _check_stall(self) -> None:
        """Watchdog: partitions have lag, this worker has free slots, yet no record came
        for `kafka.stall_timeout_s`. aiokafka has been seen to stop fetching after a group member died
        (all assigned partitions silent, no error); the remedy is a fresh consumer."""
        now = time.monotonic()
        stall_s = self.worker.cfg.kafka.stall_timeout_s
        if now - self._last_progress < stall_s or now - self._last_stall_check < stall_s / 2:
            return
        self._last_stall_check = now
        assigned = list(self.consumer.assignment())
        if not assigned:
            return
        try:
            ends = await asyncio.wait_for(self.consumer.end_offsets(assigned), 10)
            committed = await asyncio.wait_for(
                asyncio.gather(*(self.consumer.committed(tp) for tp in assigned)), 10)
        except (TimeoutError, KafkaError, IllegalStateError) as e:
            # The broker does not answer: that is an outage (readiness reports it), not a
            # stalled consumer; a fresh consumer would not fetch either. Check again later.
            # Quiet while it may be a broker restart (kafka.transient_grace_s).
            level, fields = transient_log.observe("broker_unreachable")
            log.log(level, "stall check could not reach Kafka; not recreating the consumer", error=repr(e), **fields)
            return
        lagging = [tp for tp, c in zip(assigned, committed)
                   if ends[tp] > max(c or 0, self.worker.tracker.last_taken(tp) + 1)]
        if not lagging:
            self._last_progress = now
            return
        log.warning("consumer stalled: partitions have unread jobs but nothing was fetched; recreating it",
                    stalled_s=round(now - self._last_progress, 1))
        self.num_consumer_restarts += 1
        self.worker.metrics.consumer_restarts.inc()
        old = self.consumer
        try:
            await asyncio.wait_for(old.stop(), 15)  # commits via the revoke callback, leaves the group
        except Exception as e:  # a wedged consumer: abandon it
            log.warning("stalled consumer did not stop cleanly", error=repr(e))
        self.consumer = self._make_consumer()
        self.consumer.subscribe(list(self.topics), listener=_Rebalance(self))
        await self.consumer.start()
        self._last_progress = time.monotonic()

    async def stop(self) -> None:
        await self.commit()
        await self.consumer.stop()  # leaves the group: partitions go to other workers now
        await self.producer.stop()

    # ---- the consume loop ------------------------------------------------------------
    async def run(self, stopping: asyncio.Event) -> None:
        """Consume until `stopping`. Broker errors back off and retry; anything else
        propagates (the worker stops and its jobs are redelivered)."""
        worker = self.worker
        last_contested = 0.0
        while not stopping.is_set():
            try:
                free = 0 if worker.draining else worker.max_local_jobs - worker.num_local_jobs
                # hysteresis: once paused, resume only when a quarter of the slots are free
                resume_at = max(1, worker.max_local_jobs // 4) if self.paused else 1
                self._set_paused(free < resume_at)
                if self.paused:
                    free = 0
                records = await self._fetch(free)
                if records or free <= 0:
                    self._last_progress = time.monotonic()
                else:
                    await self._check_stall()
                generation = self.generation
                for prio in keys.PRIORITIES:
                    for rec in records.get(prio, ()):
                        if self.generation != generation:
                            # A rebalance during this batch: every kept partition is re-read
                            # from its committed offset, so the rest comes again.
                            break
                        await self.handle(rec, prio)
                now = time.monotonic()
                if self.contested and now - last_contested > 0.5:
                    last_contested = now
                    await self._retry_contested()
                if now - self._last_commit > worker.cfg.kafka.commit_interval_ms / 1000:
                    await self.commit()
            except (KafkaError, IllegalStateError) as e:
                level, fields = transient_log.observe_error(e)
                log.log(level, "Kafka error in the consume loop; retrying", error=repr(e), **fields)
                await asyncio.sleep(0.5)

    def _set_paused(self, pause: bool) -> None:
        assigned = self.consumer.assignment()
        if pause:
            self.consumer.pause(*assigned)
        elif self.paused or self.consumer.paused():
            self.consumer.resume(*assigned)
        self.paused = pause

    async def _fetch(self, free: int) -> dict[str, list[ConsumerRecord]]:
        """Up to `free` records, high-priority partitions first. Always calls getmany."""
        if free <= 0:
            await self.consumer.getmany(timeout_ms=100)  # paused: returns nothing, keeps us in the group
            return {}
        assigned = self.consumer.assignment()
        out: dict[str, list] = {}
        for prio in keys.PRIORITIES:
            if free <= 0:
                break
            tps = [tp for tp in assigned if self.topics.get(tp.topic) == prio]
            if not tps:
                continue
            got = await self.consumer.getmany(*tps, timeout_ms=0, max_records=free)
            recs = [r for tp in sorted(got, key=lambda t: t.partition) for r in got[tp]]
            if recs:
                out[prio] = recs
                free -= len(recs)
        if not out:
            got = await self.consumer.getmany(timeout_ms=200, max_records=free)
            for tp, recs in got.items():
                out.setdefault(self.topics[tp.topic], []).extend(recs)
        return out

    # ---- one record ------------------------------------------------------------------
    async def handle(self, rec: ConsumerRecord, priority: str) -> None:
        worker = self.worker
        tp = TopicPartition(rec.topic, rec.partition)
        if tp not in self.consumer.assignment() or not worker.tracker.add(tp, rec.offset):
            return  # not ours any more, or already taken (re-read after a rebalance)
        enqueue = rec.timestamp / 1000.0
        bound = log.bind(topic=rec.topic, partition=rec.partition, offset=rec.offset)
        try:
            job = decode_job(rec.value or b"")
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            await self.dead_letter(rec, tp, str(e), bound)
            return
        c = JobRecord(job, priority, tp, rec.offset, enqueue)
        if not await self._take(c):
            bound.info("job claimed by another worker; waiting", job_id=job.job_id)
            self.contested.append(c)

    async def _take(self, c: JobRecord) -> bool:
        """Attach the record to the job running here, skip it if the job already ended, or
        claim and start it. False if another worker holds the claim (retried later)."""
        worker = self.worker
        local = worker.jobs.get(c.job.job_id)
        if local is not None:  # redelivered to us while we run it: answer both records at the end
            local.offsets.append((c.tp, c.offset))
            return True
        if await worker.is_done(c.job.job_id):
            worker.tracker.done(c.tp, c.offset)
            return True
        claim = await worker.try_claim(c.job.job_id)
        if claim is None:
            return False
        await worker.start_job(c.job, c.priority, c.tp, c.offset, c.enqueue_time, claim)
        return True

    async def _retry_contested(self) -> None:
        still = []
        for c in self.contested:
            if not await self._take(c):
                still.append(c)
        self.contested = still

    async def dead_letter(self, rec: ConsumerRecord, tp: TopicPartition, error: str, bound) -> None:
        """Poison record: DLQ with the original bytes, `finished(rejected)` if a job_id is
        recoverable, offset done. Never blocks the partition."""
        job_id = recover_job_id(rec.value or b"")
        headers = [
            (DLQ_HEADER_ERROR, error.encode()[:4096]),
            (DLQ_HEADER_SOURCE_TOPIC, rec.topic.encode()),
            (DLQ_HEADER_SOURCE_PARTITION, str(rec.partition).encode()),
            (DLQ_HEADER_SOURCE_OFFSET, str(rec.offset).encode()),
            (DLQ_HEADER_WORKER_ID, self.worker.worker_id.encode()),
        ]
        if job_id:
            headers.append((DLQ_HEADER_JOB_ID, job_id.encode()))
        await self.producer.send_and_wait(self.dlq_topic, value=rec.value, key=rec.key, headers=headers)
        self.num_dead_letters += 1
        self.worker.metrics.dlq_records.inc()
        self.worker.metrics.rejected.labels("invalid_job").inc()
        bound.warning("invalid job record sent to the DLQ", error=error[:300], job_id=job_id,
                      size=len(rec.value or b""))
        if job_id and not await self.worker.is_done(job_id):
            claim = await self.worker.try_claim(job_id)
            if claim is not None:
                await self.worker.finish_without_running(job_id, claim, "rejected", "invalid_job", error, [(tp, rec.offset)])
                return
        self.worker.tracker.done(tp, rec.offset)

    # ---- commits -----------------------------------------------------------------------
    async def commit(self, only: set[TopicPartition] | None = None) -> None:
        self._last_commit = time.monotonic()
        tracker = self.worker.tracker
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
            self.worker.metrics.commit_failures.inc()
            return
        for tp, off in points.items():
            tracker.mark_committed(tp, off)

    def lag(self, end_offsets: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Consumer lag per partition: log end offset minus the committed offset (what
        Kafka's tools and KEDA call lag; includes jobs running here, not yet committed)."""
        lags = {}
        for tp, end in end_offsets.items():
            committed = self.worker.tracker.committed(tp)
            lags[tp] = 0 if committed is None else max(0, end - committed)
        return lags
