"""From fetched records to engine requests: claim a batch, decide what each job gets
(run, skip, end at once), and process inputs off the event loop.

For each claimed job, in this order (the first that applies wins):
  cancel tombstone      -> `finished(cancelled)`
  deadline passed       -> `finished(expired)`, code `deadline_passed`
  failures >= limit     -> `finished(error)`, code `poison`, and the record to the DLQ
  prompt over the bound -> `finished(rejected)`, code `prompt_too_long`, and the DLQ
  engine rejects it     -> `finished(rejected)` with the engine's reason, and the DLQ
  else                  -> in the engine (`started`, tokens, `finished`)

Tokenization and chat templates run in a small thread pool as separate tasks, so a slow
input never holds up intake of the jobs behind it, and a prompt whose UTF-8 size alone
proves it cannot fit `max_input_tokens` is refused before any tokenizer work
(`prompt_byte_limit`).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import structlog

from schemas.wire import ErrorInfo, FinishReason, Job
from worker.claims import REDIS_DOWN, Claimed, ClaimStore, Contested, Done, EpochChanged
from worker.engine import RequestRejected
from worker.intake import JobRecord
from worker.jobs import JobTable, LocalJob, Offset

if TYPE_CHECKING:
    from worker.dlq import DeadLetters
    from worker.engine import Engine
    from worker.metrics import Metrics
    from worker.offsets import OffsetTracker

log = structlog.get_logger(__name__)

UTF8_MAX_BYTES_PER_CHAR = 4


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound of the UTF-8 bytes one token can stand for: the longest vocabulary
    entry (byte-level BPE and SentencePiece spell each token with at least as many bytes
    as it decodes to; added tokens are literal text). 4 if the tokenizer has no vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return 4
    return max((len(t.encode("utf-8", "surrogatepass")) for t in get_vocab()), default=4)


def prompt_byte_limit(tokenizer: Any, max_input_tokens: int) -> int:
    """Prompts longer than this many UTF-8 bytes cannot tokenize to `max_input_tokens` or
    fewer: max tokens x bytes per token x 4 (room for normalizers that fold a multi-byte
    character into one byte). Refusing them needs no tokenizer work."""
    return (max_input_tokens + 8) * max_token_bytes(tokenizer) * UTF8_MAX_BYTES_PER_CHAR


def input_bytes(job: Job) -> int:
    if job.prompt is not None:
        return len(job.prompt.encode("utf-8", "surrogatepass"))
    if job.messages is not None:
        return sum(len(m.content.encode("utf-8", "surrogatepass")) + len(m.role) for m in job.messages)
    return 0


class JobStarter:
    """Implements the intake's `JobSink`. Args:
    table, claims, tracker: the worker's job table, claim store, offset tracker.
    engine: accepts requests (`add_request`, thread-safe) and aborts.
    dead_letters: the DLQ writer.
    metrics: the worker's metrics.
    max_local_jobs: jobs held at once (claimed, in the engine, finishing).
    max_job_failures: earlier unclean attempts after which a job is poison.
    wake: called when the table has new drafts or the engine has new work.
    restore: awaited when Redis lost its data (then the batch is claimed again).
    is_paused: True while intake must take nothing (draining, Redis down).
    tokenizer_threads: size of the input-processing pool.
    """

    def __init__(self, table: JobTable, claims: ClaimStore, tracker: OffsetTracker, engine: Engine,
                 dead_letters: DeadLetters, metrics: Metrics, *, max_local_jobs: int, max_job_failures: int,
                 wake, restore, is_paused, tokenizer_threads: int = 2) -> None:
        self.table = table
        self.claims = claims
        self.tracker = tracker
        self.engine = engine
        self.dead_letters = dead_letters
        self.metrics = metrics
        self.max_local_jobs = max_local_jobs
        self.max_job_failures = max_job_failures
        self._wake = wake
        self._restore = restore
        self._is_paused = is_paused
        self._pool = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="inflight-input")
        self._tasks: set[asyncio.Task] = set()
        self._byte_limit = prompt_byte_limit(engine.tokenizer, engine.tuning.max_input_tokens)

    def free_slots(self) -> int:
        if self._is_paused():
            return 0
        return self.max_local_jobs - len(self.table)

    def held_by_tenant(self) -> dict[str, int]:
        return self.table.held_by_tenant()


    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- a fetched batch -----------------------------------------------------------------
    async def take(self, records: list[JobRecord]) -> list[JobRecord]:
        fresh = []
        for rec in records:
            if not self.table.attach_offset(rec.job.job_id, Offset(rec.tp, rec.offset)):
                fresh.append(rec)  # else: redelivered while it runs here; answered by the same end
        if not fresh:
            return []
        try:
            results = await self.claims.take([r.job.job_id for r in fresh])
        except EpochChanged:
            await self._restore()
            results = await self.claims.take([r.job.job_id for r in fresh])
        except REDIS_DOWN as e:
            log.info("claims unavailable; will retry the batch", error=repr(e)[:200], records=len(fresh))
            return fresh
        contested = []
        for rec, res in zip(fresh, results):
            if isinstance(res, Done):
                self.tracker.done(rec.tp, rec.offset)
            elif isinstance(res, Contested):
                log.info("job claimed by another worker; waiting", job_id=rec.job.job_id, topic=rec.tp.topic,
                         partition=rec.tp.partition, offset=rec.offset)
                contested.append(rec)
            elif self.table.get(rec.job.job_id) is not None:  # duplicate within the batch
                self.table.attach_offset(rec.job.job_id, Offset(rec.tp, rec.offset))
            else:
                self._open(rec, res)
        self._wake()
        return contested

    def _open(self, rec: JobRecord, c: Claimed) -> None:
        job = rec.job
        lj = self.table.open(job, rec.priority, Offset(rec.tp, rec.offset), rec.enqueue_time, c.token, c.attempt,
                             c.next_seq, raw=rec.raw, raw_key=rec.key)
        if c.cancelled:
            self.table.finish_local(job.job_id, FinishReason.CANCELLED)
        elif job.deadline is not None and job.deadline < time.time():
            self.table.finish_local(job.job_id, FinishReason.EXPIRED, ErrorInfo(
                code="deadline_passed", message=f"deadline {job.deadline} passed before the job started"))
        elif c.failures >= self.max_job_failures:
            msg = (f"{c.failures} earlier attempts never ended (a worker died running it); not run again "
                   f"(worker.max_job_failures = {self.max_job_failures})")
            log.warning("poison job not run again", job_id=job.job_id, attempt=c.attempt, failures=c.failures)
            self.table.finish_local(job.job_id, FinishReason.ERROR, ErrorInfo(code="poison", message=msg),
                                    dead_letter=("poison", msg))
        elif input_bytes(job) > self._byte_limit:
            self._reject(lj, RequestRejected(job.job_id, _prompt_too_long(), (
                f"prompt is {input_bytes(job)} bytes; more than {self._byte_limit} bytes can never tokenize "
                f"to max_input_tokens = {self.engine.tuning.max_input_tokens}")))
        else:
            task = asyncio.create_task(self._submit(lj), name=f"input:{job.job_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _submit(self, lj: LocalJob) -> None:
        job = lj.job
        kwargs: dict[str, Any] = {"params": job.params, "priority": lj.priority, "cache_salt": job.tenant or "",
                                  "tenant": job.tenant, "arrival_time": lj.enqueue_time, "deadline": job.deadline}
        if job.prompt is not None:
            kwargs["prompt"] = job.prompt
        elif job.messages is not None:
            kwargs["messages"] = [{"role": m.role, "content": m.content} for m in job.messages]
        else:
            kwargs["prompt_token_ids"] = job.prompt_token_ids
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, lambda: self.engine.add_request(job.job_id, **kwargs))
        except RequestRejected as e:
            self._reject(lj, e)
            return
        self.table.accepted(job.job_id)
        if lj.cancel_time_mono is not None:
            self.engine.abort(job.job_id)
        self._wake()

    def _reject(self, lj: LocalJob, e: RequestRejected) -> None:
        self.metrics.rejected.labels(e.reason.value).inc()
        self.table.finish_local(lj.job_id, FinishReason.REJECTED, ErrorInfo(code=e.reason.value, message=e.message),
                                dead_letter=(e.reason.value, e.message))
        self._wake()

    # ---- records that are not jobs ---------------------------------------------------------
    async def reject_invalid(self, rec: JobRecord, job_id: str | None) -> None:
        """DLQ with the original bytes; `finished(rejected)`, code `invalid_job`, when a job id
        is readable and nobody has answered it yet; the offset is done once that is out."""
        tp, error = rec.tp, rec.error or "invalid job"
        await self.dead_letters.send(rec.raw, rec.key, topic=tp.topic, partition=tp.partition, offset=rec.offset,
                                     reason="invalid_job", error=error, job_id=job_id)
        self.metrics.dlq_records.inc()
        self.metrics.rejected.labels("invalid_job").inc()
        log.warning("invalid job record sent to the DLQ", error=error[:300], job_id=job_id, topic=tp.topic,
                    partition=tp.partition, offset=rec.offset, size=len(rec.raw))
        if job_id and job_id not in self.table:
            try:
                res = (await self.claims.take([job_id]))[0]
            except (EpochChanged, *REDIS_DOWN):
                res = None
            if isinstance(res, Claimed):
                self.table.open(Job(job_id=job_id, prompt=""), rec.priority, Offset(tp, rec.offset), rec.enqueue_time,
                                res.token, res.attempt, res.next_seq)
                self.table.finish_local(job_id, FinishReason.REJECTED, ErrorInfo(code="invalid_job", message=error))
                self._wake()
                return
        self.tracker.done(tp, rec.offset)


def _prompt_too_long():
    from worker.engine import RejectReason

    return RejectReason.PROMPT_TOO_LONG
