"""The last step of a job: after its terminal event is in Redis, the record goes to the DLQ
if it never ran (`dlq.py`'s rule), the terminal event to the durable results topic
(`results.py`), and only then are its offsets done (committed by the intake) and the job
leaves the table; its metrics and its one summary log line are written here.

The finalizer is the one writer of the DLQ and the one caller of `OffsetTracker.done`:
records that never become a job here (undecodable ones, `dead_letter_record` then
`release`; ones a done mark in Redis already answers, `settle`; jobs of another pool,
`forward`) end through it too.

Kafka errors are retried with backoff while the offsets stay open; a refusal (missing
ACL) stops the worker: every write, re-recorded outcomes (`settle`) and forwards included,
runs in the `run` loop (a worker task), never in a task of its own whose failure nobody
would see (that left offsets open for good). Jobs are finalized in batches: every job that
ended in a publisher round goes through one results write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import msgspec
import structlog
from aiokafka.errors import KafkaError, KafkaTimeoutError

from schemas.codec import decode_event
from schemas.wire import Finished, FinishReason
from worker.obs.stopping import honour_cancellation, stop_within
from worker.security.redis import REDIS_DOWN

if TYPE_CHECKING:
    from aiokafka import TopicPartition

    from schemas.pools import Pool
    from worker.obs.metrics import Metrics
    from worker.serve.claims import ClaimStore
    from worker.serve.dlq import DeadLetters
    from worker.serve.jobs import JobTable, LocalJob
    from worker.serve.kafka_outage import KafkaOutage
    from worker.serve.offsets import OffsetTracker
    from worker.serve.pool_router import PoolRouter
    from worker.serve.read_ahead import JobRecord
    from worker.serve.results import ResultsLog

log = structlog.get_logger(__name__)


class Finalizer:
    """Ends what the table finished: DLQ records, the results topic, offsets done; the only DLQ writer.

    Args: the worker's job table, offset tracker, DLQ and results writers, metrics."""

    def __init__(self, table: JobTable, tracker: OffsetTracker, dead_letters: DeadLetters, results: ResultsLog,
                 metrics: Metrics, outage: KafkaOutage | None = None) -> None:
        self.outage = outage
        self.table = table
        self.tracker = tracker
        self.dead_letters = dead_letters
        self.results = results
        self.metrics = metrics
        self.num_finished = 0
        # jobs whose terminal event was published, and other work for the run loop (callables)
        self._queue: asyncio.Queue[LocalJob | Callable[[], Awaitable[None]]] = asyncio.Queue()
        # labelled children looked up once (a `labels()` call per job costs more than the observation)
        self._finished = {r: metrics.finished.labels(r.value) for r in FinishReason}
        self._by_priority: dict[str, tuple] = {}
        self._settling: list[tuple[TopicPartition, int, str, bytes]] = []
        self._settle_queued = False
        self._forwarding: dict[str, LocalJob] = {}  # forwards queued or under way, by job id
        self.num_settled = 0  # records of done jobs whose results record was written again

    async def dead_letter_record(self, rec: JobRecord, reason: str, error: str, job_id: str | None) -> None:
        """Send a record that is not a job (it does not decode or validate) to the DLQ
        with its original bytes, and count it. Its offset stays open (`release` it, or it
        is done with the job opened for it).

        Raises:
            aiokafka.errors.KafkaError, worker.security.access.Refused: as `DeadLetters.send`.
        """
        tp = rec.tp
        await _reporting_waits(self.dead_letters.send(rec.raw, rec.key, topic=tp.topic, partition=tp.partition,
                                                      offset=rec.offset, reason=reason, error=error, job_id=job_id),
                               "send a record to the DLQ", self.outage)
        self.metrics.dlq_records.labels(reason).inc()

    def forward(self, held: LocalJob, target: Pool, router: PoolRouter, claims: ClaimStore) -> None:
        """A claimed job that belongs to another pool (`pool_router.py`), already handed
        back from the table: in the run loop, its claim is given back with the attempt
        undone, its record produced to `target`'s topic (Kafka errors retried while the
        offset stays open), then its offsets are done. A refusal (missing Write ACL on the
        target's topic) stops the worker."""
        self._forwarding[held.job_id] = held
        self._queue.put_nowait(lambda: self._forward(held, target, router, claims))

    @property
    def num_forwarding(self) -> int:
        """Forwards queued or under way (a draining worker waits for them: `Worker.drain`)."""
        return len(self._forwarding)

    async def give_back_forwards(self, claims: ClaimStore) -> None:
        """At the end of a drain: the claims of forwards not done yet are given back with
        their attempts undone (their offsets stay open: the records are read again and
        forwarded by another worker, as attempt 1), not left to run out as a crash would."""
        pending = list(self._forwarding.values())
        if pending:
            await stop_within("drain: give back the claims of unforwarded jobs",
                              claims.unclaim([(h.job_id, h.claim_token, h.attempt) for h in pending]), 5)
            log.info("gave back the claims of jobs not forwarded yet", job_ids=[h.job_id for h in pending][:20],
                     count=len(pending))

    async def _forward(self, held: LocalJob, target: Pool, router: PoolRouter, claims: ClaimStore) -> None:
        try:
            await self._forward_one(held, target, router, claims)
        finally:
            self._forwarding.pop(held.job_id, None)

    async def _forward_one(self, held: LocalJob, target: Pool, router: PoolRouter, claims: ClaimStore) -> None:
        # The claim first: the target pool's worker then finds the job free when the
        # record reaches it (given back after the send, it found the job claimed and
        # waited). A crash after this leaves the offset open: the record is read again
        # here, claimed again as the same attempt, and forwarded again.
        try:
            await claims.unclaim([(held.job_id, held.claim_token, held.attempt)])
        except REDIS_DOWN as e:  # its lease runs out instead: the target pool then runs the next attempt
            log.info("could not give back a forwarded job's claim", job_id=held.job_id, error=repr(e)[:200])
        await _retrying(lambda: router.send(held, target), f"forward a job to pool {target.name}", [held.job_id],
                        self.outage)
        for o in held.offsets:
            self.tracker.done(o.tp, o.offset)
        self.metrics.forwarded.labels(router.own.name, target.name).inc()
        first = held.offsets[0]
        log.info("job forwarded", job_id=held.job_id, topic=first.tp.topic, partition=first.tp.partition,
                 offset=first.offset, pool=router.own.name, to_pool=target.name, priority=held.priority)

    def release(self, tp: TopicPartition, offset: int) -> None:
        """A record answered without a job held here (dead-lettered with no stream to
        answer): its offset may be committed. Records of jobs already done: `settle`."""
        self.tracker.done(tp, offset)

    def settle(self, tp: TopicPartition, offset: int, job_id: str, tail: tuple[bytes, ...]) -> None:
        """A record whose job a done mark in Redis already answers. The worker that ended
        it may have died between publishing the terminal event and writing the results
        record, so the terminal event found in `tail` (its log's last event JSONs,
        `claims.Done`) is written to the results topic again (compaction keeps one per job
        id), then the offset is done; with none found (the log expired or was lost), the
        offset is done at once. Kafka errors are retried with backoff meanwhile."""
        for data in tail:
            try:
                ev = decode_event(data)
            except (msgspec.DecodeError, msgspec.ValidationError):  # a damaged entry: look further
                continue
            if isinstance(ev, Finished) and ev.job_id == job_id:
                self._settling.append((tp, offset, job_id, data))
                if not self._settle_queued:
                    self._settle_queued = True
                    self._queue.put_nowait(self._settle)
                return
        self.tracker.done(tp, offset)

    async def _settle(self) -> None:
        self._settle_queued = False
        while self._settling:
            batch, self._settling = self._settling, []
            await _retrying(lambda b=batch: self.results.record([(job_id, data) for _, _, job_id, data in b]),
                            "re-record outcomes of done jobs", [b[2] for b in batch],
                            self.outage)
            for tp, offset, _, _ in batch:
                self.tracker.done(tp, offset)
            self.num_settled += len(batch)

    def add(self, jobs: Iterable[LocalJob]) -> None:
        """Jobs whose terminal event was just published."""
        now = time.time()
        for held in jobs:
            if held.trace is not None:
                held.trace.published_at = now
            self._queue.put_nowait(held)

    async def run(self) -> None:
        """Record outcomes, re-record settled ones and forward jobs until cancelled.

        Raises:
            worker.security.access.Refused: the principal may not write a topic (the DLQ,
                the results topic, another pool's job topic): the worker stops (exit 5).
        """
        q = self._queue
        while True:
            honour_cancellation()
            items = [await q.get()]
            while not q.empty():
                items.append(q.get_nowait())
            batch = []
            for item in items:
                if callable(item):  # settle, forward
                    await item()
                else:
                    batch.append(item)
            if not batch:
                continue
            t0 = time.time()
            await _retrying(lambda b=batch: self._record(b), "record outcomes", [j.job_id for j in batch], self.outage)
            t1 = time.time()
            for held in batch:
                if held.trace is not None:
                    held.trace.recorded = (t0, t1)
                self._done(held)

    async def _record(self, batch: list[LocalJob]) -> None:
        for held in batch:
            if held.dead_letter is not None and held.raw is not None:
                reason, message = held.dead_letter
                first = held.offsets[0]
                await self.dead_letters.send(held.raw, held.raw_key, topic=first.tp.topic, partition=first.tp.partition,
                                             offset=first.offset, reason=reason, error=message, job_id=held.job_id)
                self.metrics.dlq_records.labels(reason).inc()
                held.raw = None
        await self.results.record([(held.job_id, held.history[-1].data) for held in batch if held.history])

    def _priority_metrics(self, priority: str) -> tuple:
        m = self._by_priority.get(priority)
        if m is None:
            mm = self.metrics
            m = self._by_priority[priority] = (mm.e2e.labels(priority), mm.tpot.labels(priority),
                                               mm.queue_time.labels(priority))
        return m

    def _done(self, held: LocalJob) -> None:
        m = self.metrics
        reason = held.finish_reason or FinishReason.ERROR
        self._finished[reason].inc()
        summary = held.summary
        trace = held.trace
        if held.opened:  # it ran in the engine: latency and token metrics
            e2e, tpot, queue = self._priority_metrics(held.priority)
            exemplar = trace.exemplar if trace is not None else None  # OpenMetrics exemplars: the job's trace
            if summary.get("e2e_s") is not None:
                e2e.observe(summary["e2e_s"], exemplar)
            if summary.get("tpot_s") is not None:
                tpot.observe(summary["tpot_s"], exemplar)
            if summary.get("queue_s") is not None:
                queue.observe(summary["queue_s"], exemplar)
                m.observe_tenant_queue_time(held.tenant, summary["queue_s"])
            if summary.get("prompt_tokens"):
                m.prompt_tokens.inc(summary["prompt_tokens"])
                m.prefix_cache_queries.inc(summary["prompt_tokens"])
                m.prefix_cache_hits.inc(summary.get("cached_prompt_tokens") or 0)
                m.observe_tenant_tokens(held.tenant, "prompt", summary["prompt_tokens"])
            if reason == FinishReason.CANCELLED:
                m.aborted.labels("cancelled").inc()
                if held.cancel_time_mono is not None:
                    m.cancel_to_free.observe(time.monotonic() - held.cancel_time_mono)
        for off in held.offsets:
            self.tracker.done(off.tp, off.offset)
        self.table.done(held)
        self.num_finished += 1
        first = held.offsets[0]
        log.info("job finished", job_id=held.job_id, topic=first.tp.topic, partition=first.tp.partition,
                 offset=first.offset, finish_reason=reason.value, attempt=held.attempt, priority=held.priority,
                 tokens=held.num_tokens, **summary)
        if trace is not None:  # after the line above, which carries its ids
            trace.end(time.time())


UNACKED_REPORT_S = 30.0
"""A Kafka write not acknowledged for this long is reported as an outage (and again each
time this passes) while it goes on waiting: the producer is idempotent, and aiokafka never
expires an idempotent producer's batch (no leader, or fewer replicas in sync than
`min.insync.replicas`: it retries until the cluster takes it), so without this a write
stuck that way would never count toward `kafka.outage_limit_s`."""


async def _retrying(write, what: str, job_ids: list[str], outage: KafkaOutage | None = None) -> None:
    """Await `write()` until Kafka takes it: a `KafkaError` is reported to `outage`, logged
    (the first of a run at warning, repeats at debug) and retried with backoff (0.1 s
    doubling to 5 s) while the offsets stay open; a write that waits past
    `UNACKED_REPORT_S` is reported too but not abandoned (re-sending it could write the
    record twice); anything else (a refusal) propagates."""
    delay = 0.1
    failures = 0
    while True:
        honour_cancellation()
        try:
            await _reporting_waits(write(), what, outage)
            if outage is not None:
                outage.ok("results")
            return
        except KafkaError as e:
            if outage is not None:
                outage.failed("results", e)
            failures += 1
            log.log(logging.WARNING if failures == 1 else logging.DEBUG, f"could not {what} in Kafka; retrying",
                    error=repr(e)[:200], job_ids=job_ids[:20], num_jobs=len(job_ids), failures=failures)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def _reporting_waits(write: Awaitable[None], what: str, outage: KafkaOutage | None) -> None:
    task = asyncio.ensure_future(write)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=UNACKED_REPORT_S)
            if done:
                return task.result()
            log.warning(f"still waiting for Kafka to acknowledge: {what}", waited_s=UNACKED_REPORT_S)
            if outage is not None:
                outage.failed("results", KafkaTimeoutError(f"{what}: no acknowledgement in {UNACKED_REPORT_S} s "
                                                           "(no leader, or too few in-sync replicas)"))
    finally:
        if not task.done():  # the caller was cancelled (a stop): so is the write
            task.cancel()
