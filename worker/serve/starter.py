"""From fetched records to engine requests: claim a batch, decide what each job gets
(run, skip, end at once), and process inputs off the event loop.

For each claimed job, in this order (the first that applies wins):
  cancel tombstone      -> `finished(cancelled)`
  deadline passed       -> `finished(expired)`, code `deadline_passed`
  failures >= limit     -> `finished(error)`, code `poison`, and the record to the DLQ
  prompt over the bound -> `finished(rejected)`, code `prompt_too_long`, and the DLQ
  engine rejects it     -> `finished(rejected)` with the engine's reason, and the DLQ
  else                  -> in the engine (`started`, tokens, `finished`)

Poison jobs (a forward that kills the process, as a crashing kernel would): the failure
mark of an attempt is set when it is claimed (a suspect's, only when it enters the
engine alone) and cleared when it ends cleanly, so a worker that dies leaves a mark on
every job it held — the culprit and its innocent neighbours alike. A job with a mark
therefore runs *alone* (`worker.serve.isolation.IsolationGate`). If it kills that worker
too, the death is its own; at `worker.max_job_failures` marks (default 2: one crash
among neighbours, one alone) it is not run again — once `worker.poison_grace_s` has
passed since a claim first found it there: a worker that stalled past its lease leaves a
mark too, and clears it when it comes back (`leases.py`); meanwhile the job is given
back and retried as a contested record (`_suspects_wait`).

Small inputs (token ids, prompts up to `INLINE_INPUT_BYTES`) are processed on the event
loop, cheaper than a thread hop; larger ones are tokenized (chat templates rendered) in
a small thread pool as separate tasks, so a slow input never holds up intake of the
jobs behind it; a prompt whose UTF-8 size alone proves it cannot fit `max_input_tokens`
is refused before any tokenizer work (`prompt_byte_limit`).

A batch of at most `EARLY_INPUT_RECORDS` records has its small text and chat prompts
tokenized while its claim is in flight (the claim's round trip to Redis and the
tokenizer's work overlap instead of adding up: a first token's time at low load). The
ids are only data until the claim answers: a record whose claim is refused (done,
contested) is not opened, one a start rule ends (cancelled, expired, poison) is not
processed, and their ids are dropped. Larger batches (a partition caught up after a
rebalance, mostly records already answered) tokenize after their claims, so no work is
spent on jobs that never run here.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple, Protocol

import structlog

from schemas.codec import recover_tenant
from schemas.keys import JobRef
from schemas.wire import ErrorInfo, FinishReason, Job
from worker.engine import EngineCoreRequest, RequestRejected
from worker.engine.inputs import ChatPrompt, Prompt, RequestInput, TextPrompt, TokenPrompt
from worker.engine.outputs import RequestOptions
from worker.obs.tracing import OFF, Tracing
from worker.security.access import is_fatal_redis
from worker.security.redis import REDIS_DOWN
from worker.serve.claims import Claimed, ClaimStore, Contested, Done, EpochChanged
from worker.serve.input_size import INLINE_INPUT_BYTES, input_bytes, prompt_byte_limit
from worker.serve.isolation import IsolationGate
from worker.serve.jobs import JobState, JobTable, LocalJob, Offset
from worker.serve.pool_router import Misrouted, PoolRouter
from worker.serve.read_ahead import JobRecord

if TYPE_CHECKING:
    from worker.engine.core_client import EngineClient
    from worker.obs.metrics import Metrics
    from worker.serve.cancels import CancelListener
    from worker.serve.finalize import Finalizer
    from worker.serve.fleet_quota import FleetQuota

log = structlog.get_logger(__name__)

EARLY_INPUT_RECORDS = 4  # batches up to this many records tokenize while their claim is in flight


class Ending(NamedTuple):
    """How a start rule ends a job before it runs: its finish reason, error, and the DLQ
    record's (reason code, message) when the record goes there."""

    reason: FinishReason
    error: ErrorInfo | None = None
    dead_letter: tuple[str, str] | None = None


class EarlyIds(NamedTuple):
    """A prompt tokenized while its job's claim was in flight: its ids, and when the
    tokenizer started (Unix s; the trace's `tokenize` span starts there)."""

    ids: list[int]
    start: float


class StarterHost(Protocol):
    """What the job starter needs of the worker around it (`worker.serve.worker.Worker`)."""

    def wake(self) -> None:
        """The table has new drafts or the engine new work: the publisher and the engine
        loop look now."""

    def intake_paused(self) -> bool:
        """True while intake must take nothing (draining, stopping, Redis down, cancels
        not read up to the end)."""

    async def restore_redis(self, stale_epoch: str) -> None:
        """Redis lost its data (`stale_epoch` was refused): re-claim the held jobs and
        re-append their logs (`Publisher.restore`) unless that is done; the batch is then
        claimed again. Raises the Redis connection errors."""


class JobStarter:
    """Implements the intake's `JobSink`. Args:
    table, claims: the worker's job table and claim store.
    engine: the engine client (`input.process` in the pool, `submit` and `abort` on the loop).
    finalizer: ends the records that never become a job here (DLQ, offset done).
    metrics: the worker's metrics.
    host: the worker (wake, pause, restore).
    cancels: the worker's cancel listener: a job whose cancel it has read ends
        `cancelled` when claimed (whatever Redis lost).
    max_local_jobs: jobs held at once before their terminal event (claimed, in the engine);
        as many again may be finishing.
    max_job_failures: earlier unclean attempts after which a job is poison.
    poison_grace_s: how long a job at that limit waits before it is called poison
        (`worker.poison_grace_s`), seconds.
    tokenizer_threads: size of the input-processing pool.
    tracing: the worker's tracing (`worker.obs.tracing`; default off): each claimed job
        that is sampled gets its `JobTrace`.
    router: pools by prompt length (`pool_router.py`): a job whose prompt is outside this
        worker's pool is forwarded to the pool that serves it (None: no pools).
    quota: the fleet-wide tenant limits (`fleet_quota.py`; None: no tenant has one): a
        record's charge is corrected once its input is processed, and given back when
        the record is not opened here.
    """

    def __init__(self, table: JobTable, claims: ClaimStore, engine: EngineClient, finalizer: Finalizer,
                 metrics: Metrics, host: StarterHost, cancels: CancelListener, *, max_local_jobs: int,
                 max_job_failures: int, poison_grace_s: float = 0.0, tokenizer_threads: int = 2,
                 tracing: Tracing = OFF, router: PoolRouter | None = None, quota: FleetQuota | None = None) -> None:
        self.table = table
        self.quota = quota
        self.claims = claims
        self.engine = engine
        self.finalizer = finalizer
        self.metrics = metrics
        self.host = host
        self.cancels = cancels
        self.max_local_jobs = max_local_jobs
        self.max_job_failures = max_job_failures
        self.poison_grace_s = poison_grace_s
        self._pool = ThreadPoolExecutor(max_workers=tokenizer_threads, thread_name_prefix="inflight-input")
        self._tasks: set[asyncio.Task] = set()
        self._taking: dict[int, str] = {}  # id(record) -> tenant: records being claimed, not yet opened
        self.router = router if router is not None and router.active else None
        max_tokens = (self.router.byte_limit_tokens(engine.tuning.max_input_tokens) if self.router
                      else engine.tuning.max_input_tokens)
        self._byte_limit = prompt_byte_limit(engine.tokenizer, max_tokens) if max_tokens is not None else None
        self.gate = IsolationGate(table)
        self._restoring_logged = 0.0
        self.tracing = tracing

    def free_slots(self) -> int:
        """Jobs that may be taken now. A slot is a job without its terminal event yet
        (claimed, being prepared, in the engine); a finishing job, only waiting for its
        terminal event's write and its results record, holds none, so slots turn over at
        the engine's pace rather than at the pace of those writes (with 4-token jobs they
        held every second slot). Finishing jobs are bounded too, by another
        `max_local_jobs`, so a slow results topic stops intake instead of piling up."""
        if self.host.intake_paused():
            return 0
        table = self.table
        return min(self.max_local_jobs - table.num_unfinished, 2 * self.max_local_jobs - len(table))

    def held_by_tenant(self) -> dict[str, int]:
        return self.table.held_by_tenant()

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- a fetched batch -----------------------------------------------------------------
    async def take(self, records: list[JobRecord]) -> list[JobRecord]:
        """Claim and open the intake's batch; returns the contested records (another
        worker holds their job) for the intake to take again later."""
        fresh = []
        for rec in records:
            if not self.table.attach_offset(rec.job.job_id, Offset(rec.tp, rec.offset)):
                fresh.append(rec)
            else:  # redelivered while it runs here; answered by the same end
                self._refund(rec)
        if not fresh:
            return []
        for rec in fresh:
            self._taking[id(rec)] = rec.tenant
        try:
            return await self._claim_and_open(fresh)
        finally:
            for rec in fresh:
                self._taking.pop(id(rec), None)

    def holding_by_tenant(self) -> Counter[str]:
        """Jobs held here per tenant (`JobTable.held_by_tenant`) plus the records being
        taken, between the intake's take and their open (their claims in flight): what
        this worker's fleet slot reservations must cover (`fleet_quota.py`; a sync round
        that saw neither would give their slots to another worker)."""
        return Counter(self.table.held_by_tenant()) + Counter(self._taking.values())

    async def _claim_and_open(self, fresh: list[JobRecord]) -> list[JobRecord]:
        refs = [JobRef(r.job.job_id, r.job.tenant) for r in fresh]
        claim_start = time.time()
        claim = asyncio.ensure_future(self._claim(refs))
        try:
            early = await self._tokenize_early(fresh, claim)
        except BaseException:  # cancelled meanwhile: the claim goes with it, as when it was awaited
            claim.cancel()
            raise
        try:
            results = await claim
        except (EpochChanged, *REDIS_DOWN) as e:
            if is_fatal_redis(e):  # refused (credentials, certificate): not an outage to wait out
                raise
            log.info("claims unavailable; will retry the batch", error=repr(e)[:200], records=len(fresh))
            return fresh
        claimed = (claim_start, time.time())  # the claim batch's span (Unix s), for traced jobs
        contested = await self._suspects_wait(fresh, results)
        to_run: list[LocalJob] = []
        num_restoring = 0
        for rec, res in zip(fresh, results):
            if res is None:  # a suspect within its grace: given back, retried as contested
                continue
            if isinstance(res, Done):  # its outcome may predate its results record (a crash between)
                self._refund(rec)
                self.finalizer.settle(rec.tp, rec.offset, rec.job.job_id, res.tail)
            elif isinstance(res, Contested):
                if res.restoring:
                    num_restoring += 1
                else:
                    log.info("job claimed by another worker; waiting", job_id=rec.job.job_id, topic=rec.tp.topic,
                             partition=rec.tp.partition, offset=rec.offset)
                contested.append(rec)
            else:
                held = self._open(rec, res, claimed)
                if held is not None:
                    to_run.append(held)
        if num_restoring and time.monotonic() - self._restoring_logged > 5:
            self._restoring_logged = time.monotonic()
            log.info("Redis lost its data less than a claim lease ago: claiming nothing until the holders "
                     "re-claim their jobs", records=num_restoring)
        for held in to_run:
            ids = early.get(held.job_id)
            if not self.gate.must_wait(held) and held.input_bytes <= INLINE_INPUT_BYTES:
                with self.gate.entering():  # small inputs: on the loop, cheaper than a thread hop
                    self._settle(held, self._prepare(held, ids))
            else:
                task = asyncio.create_task(self._submit(held, ids), name=f"input:{held.job_id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self.host.wake()
        return contested

    async def _claim(self, refs: list[JobRef]) -> list:
        """`ClaimStore.take`, once more after Redis lost its data and the held jobs were
        restored. Raises EpochChanged and the Redis connection errors."""
        try:
            return await self.claims.take(refs)
        except EpochChanged as e:
            await self.host.restore_redis(e.epoch)
            return await self.claims.take(refs)

    async def _tokenize_early(self, records: list[JobRecord], claim: asyncio.Future) -> dict[str, EarlyIds]:
        """The small text and chat prompts of a batch of at most `EARLY_INPUT_RECORDS`,
        tokenized on the loop while `claim` is in flight (module docstring), by job id.
        A prompt the tokenizer refuses (or fails on) is left to the processing after the
        claim, which answers for it as without this; so is every prompt once the claim has
        answered."""
        if len(records) > EARLY_INPUT_RECORDS:
            return {}
        await asyncio.sleep(0)  # the claim's command goes out first: its round trip runs meanwhile
        out: dict[str, EarlyIds] = {}
        for rec in records:
            job = rec.job
            if claim.done():
                break
            if job.prompt_token_ids is not None or input_bytes(job) > INLINE_INPUT_BYTES:
                continue
            start = time.time()
            try:
                ids = self.engine.input.tokenize(job.job_id, job_prompt(job))
            except Exception:  # processed again after the claim, which answers for it
                continue
            out[job.job_id] = EarlyIds(ids, start)
        return out

    async def _suspects_wait(self, records: list[JobRecord], results: list) -> list[JobRecord]:
        """Jobs claimed at their failure limit (`max_job_failures`) before
        `poison_grace_s` has passed since a claim first found them there: the claim is
        given back (attempt undone) and the record retried as contested, its result set
        to None. A worker that stalled past its lease looks dead until it comes back;
        when it does, it clears the failure mark its attempt left (`ClaimLeases`), and
        the job runs instead of being called poison. Returns the records given back."""
        at_limit = [i for i, res in enumerate(results)
                    if isinstance(res, Claimed) and res.failures >= self.max_job_failures]
        if not at_limit or self.poison_grace_s <= 0:
            return []
        ids = [records[i].job.job_id for i in at_limit]
        try:
            ages = await self.claims.suspected_for(ids)
        except REDIS_DOWN as e:  # cannot tell: wait (the claims lapse with their leases)
            if is_fatal_redis(e):
                raise
            ages = [0.0] * len(ids)
        waiting = [(i, age) for i, age in zip(at_limit, ages) if age < self.poison_grace_s]
        if not waiting:
            return []
        for i, age in waiting:
            if age == 0.0:
                log.warning("a job reached its failure limit: waiting worker.poison_grace_s in case a stalled "
                            "worker comes back before calling it poison", job_id=records[i].job.job_id,
                            failures=results[i].failures, grace_s=self.poison_grace_s)
        give_back = [(records[i].job.job_id, results[i].token, results[i].attempt) for i, _ in waiting]
        try:
            await self.claims.unclaim(give_back)
        except REDIS_DOWN as e:
            if is_fatal_redis(e):
                raise
        out = []
        for i, _ in waiting:
            out.append(records[i])
            results[i] = None
        return out

    def _open(self, rec: JobRecord, c: Claimed, claimed: tuple[float, float]) -> LocalJob | None:
        """Open a claimed job; end it at once where a rule says so. Returns it if it
        goes on to the engine (None too for a second record of a job held here)."""
        held = self.table.open(rec, c)
        self._taking.pop(id(rec), None)  # held now (or answered by the job held): counted by the table
        if held is None:  # another record of a job held here: answered by the same end
            self._refund(rec)
            return None
        if self.tracing.enabled:
            held.trace = self.tracing.open_job(rec, held, *claimed)
        ending = self._ending(held, c)
        if ending is not None:
            self._end(held, ending)
            return None
        if held.isolated:
            log.info("an earlier attempt died with its worker; the job runs alone", job_id=held.job_id,
                     attempt=c.attempt, failures=c.failures)
        return held

    def _ending(self, held: LocalJob, c: Claimed) -> Ending | RequestRejected | None:
        """The first rule of the module docstring that ends the job before any input
        processing, or the rejection; None: it runs."""
        job = held.job
        if c.cancelled or self.cancels.is_cancelled(job.job_id):
            return Ending(FinishReason.CANCELLED)
        if job.deadline is not None and job.deadline < time.time():
            return Ending(FinishReason.EXPIRED, ErrorInfo(code="deadline_passed", message=(
                f"deadline {job.deadline} passed before the job started")))
        if c.failures >= self.max_job_failures:
            msg = (f"{c.failures} earlier attempts never ended (a worker died running it); not run again "
                   f"(worker.max_job_failures = {self.max_job_failures})")
            log.warning("poison job not run again", job_id=job.job_id, attempt=c.attempt, failures=c.failures)
            return Ending(FinishReason.ERROR, ErrorInfo(code="poison", message=msg), ("poison", msg))
        if self._byte_limit is not None and held.input_bytes > self._byte_limit:
            bound = (f"the longest prompt any pool serves, {self.router.pools.max_prompt_tokens} tokens"
                     if self.router else f"max_input_tokens = {self.engine.tuning.max_input_tokens}")
            return RequestRejected(job.job_id, _prompt_too_long(), (
                f"prompt is {held.input_bytes} bytes; more than {self._byte_limit} bytes can never tokenize to "
                f"{bound}"))
        return None

    async def _submit(self, held: LocalJob, early: EarlyIds | None = None) -> None:
        """An input processed in the thread pool, after its turn at the gate (`early`: as
        `_prepare`'s)."""
        if self.gate.must_wait(held) and not await self.gate.wait_turn(held):
            return
        if held.isolated:
            try:
                await self.claims.mark_running([(held.job_id, held.attempt)])
            except REDIS_DOWN:
                self.gate.release(held)
                return
            if held.state != JobState.CLAIMED:
                return
        with self.gate.entering():
            prepared = await asyncio.get_running_loop().run_in_executor(self._pool, self._prepare, held, early)
            self._settle(held, prepared)

    def _prepare(self, held: LocalJob, early: EarlyIds | None = None) -> EngineCoreRequest | RequestRejected | Misrouted:
        """The job's engine request, or why it cannot have one here (any thread). `early`:
        its prompt's ids, tokenized while its claim was in flight (`_tokenize_early`)."""
        t0 = time.time() if early is None else early.start
        try:
            prompt = None if early is None else TokenPrompt(early.ids)
            if self.router is not None:  # with pools, the prompt's length decides the pool: count it first
                if prompt is None:
                    prompt = TokenPrompt(self.engine.input.tokenize(held.job_id, job_prompt(held.job)))
                self.router.check(len(prompt.token_ids))
            return self.engine.input.process(request_input(held, prompt))
        except (RequestRejected, Misrouted) as e:
            return e
        finally:
            if held.trace is not None:
                held.trace.tokenize = (t0, time.time())

    def _settle(self, held: LocalJob, prepared: EngineCoreRequest | RequestRejected | Misrouted) -> None:
        if isinstance(prepared, RequestRejected):
            self._end(held, prepared)
        elif isinstance(prepared, Misrouted):
            self._misrouted(held, prepared)
        elif held.state == JobState.CLAIMED:  # not cancelled or handed back meanwhile
            self._hand_to_engine(held, prepared)

    def _hand_to_engine(self, held: LocalJob, req: EngineCoreRequest) -> None:
        submitted = time.time()
        try:
            self.engine.submit(req)
        except RequestRejected as e:  # duplicate id, or overloaded (overload_policy: reject)
            self._end(held, e)
            return
        if held.trace is not None:
            held.trace.submitted = submitted
        held.prompt_tokens = len(req.prompt_token_ids)
        if held.charge:  # the estimate taken at the intake becomes the exact charge
            held.charge = self.quota.correct(held.tenant or "", held.charge, held.prompt_tokens + req.max_tokens)
        self.table.accepted(held.job_id)
        if req.options.adapter is not None:
            self.metrics.lora.request(req.options.adapter)
        if held.cancel_time_mono is not None:
            self.engine.abort(held.job_id)
        self.host.wake()

    def _refund(self, rec: JobRecord) -> None:
        """A record charged at the intake that is not opened here: its charge back."""
        if self.quota is not None:
            self.quota.refund(rec)

    def _misrouted(self, held: LocalJob, e: Misrouted) -> None:
        """The prompt belongs to another pool: forward the record there (`pool_router.py`),
        or reject it (`PoolRouter.why_not_forward`)."""
        why = self.router.why_not_forward(e, held.headers)
        if why is not None:
            self._end(held, RequestRejected(held.job_id, _prompt_too_long(), why))
            return
        if self.table.hand_back(held.job_id) is None:  # it ended meanwhile (a cancel)
            return
        self.finalizer.forward(held, e.target, self.router, self.claims)
        self.host.wake()

    def _end(self, held: LocalJob, ending: Ending | RequestRejected) -> None:
        """End a job that never runs here: its terminal event, and its record to the DLQ
        where the ending says so (every rejection does)."""
        if isinstance(ending, RequestRejected):
            code = ending.reason.value
            self.metrics.rejected.labels(code).inc()
            ending = Ending(FinishReason.REJECTED, ErrorInfo(code=code, message=ending.message),
                            (code, ending.message))
        self.table.finish_local(held.job_id, *ending)
        self.host.wake()

    # ---- records that are not jobs ---------------------------------------------------------
    async def reject_invalid(self, rec: JobRecord, job_id: str | None) -> None:
        """DLQ with the original bytes; `finished(rejected)`, code `invalid_job`, when a job id
        is readable and nobody has answered it yet (on its tenant's stream when the record
        holds a valid tenant, else on the stream of jobs without one); the offset is done
        once that is out."""
        tp, error = rec.tp, rec.error or "invalid job"
        await self.finalizer.dead_letter_record(rec, "invalid_job", error, job_id)
        self.metrics.rejected.labels("invalid_job").inc()
        log.warning("invalid job record sent to the DLQ", error=error[:300], job_id=job_id, topic=tp.topic,
                    partition=tp.partition, offset=rec.offset, size=len(rec.raw or b""))
        if job_id and job_id not in self.table:
            tenant = recover_tenant(rec.raw or b"")  # its stream is where the producer's reader waits
            claim_start = time.time()
            try:
                res = (await self.claims.take([JobRef(job_id, tenant)]))[0]
            except (EpochChanged, *REDIS_DOWN):
                res = None
            if isinstance(res, Claimed):
                held = self.table.open_rejected(rec, res, job_id, tenant)
                held.raw = None  # the DLQ record is written already
                if self.tracing.enabled:
                    held.trace = self.tracing.open_job(rec, held, claim_start, time.time())
                # the DLQ record is written already (held.raw is None: not again); it marks the trace
                self.table.finish_local(job_id, FinishReason.REJECTED, ErrorInfo(code="invalid_job", message=error),
                                        dead_letter=("invalid_job", error))
                self.host.wake()
                return
        self.finalizer.release(tp, rec.offset)


def request_input(held: LocalJob, prompt: Prompt | None = None) -> RequestInput:
    """The engine's request for a held job: its prompt (`job_prompt`, unless given: its
    ids tokenized already), params and options: its tenant (also its cache salt),
    deadline and adapter, its topic's priority class, the record's timestamp as its
    arrival (Unix s), and whether its trace is sampled. The one place a job field the
    engine reads is mapped: the engine itself knows no wire schema."""
    job = held.job
    options = RequestOptions(held.priority, job.tenant, job.tenant or "", held.enqueue_time, job.deadline,
                             job.adapter, held.trace is not None)
    return RequestInput(job.job_id, job_prompt(job) if prompt is None else prompt, job.params, options)


def job_prompt(job: Job) -> Prompt:
    """The job's prompt as the engine takes it: text, chat messages (with their tools and
    template arguments) or token ids; exactly one is set (the wire schema checks it)."""
    if job.prompt is not None:
        return TextPrompt(job.prompt)
    if job.messages is not None:
        return ChatPrompt([m.template_dict() for m in job.messages], job.tools, job.chat_template_kwargs)
    return TokenPrompt(job.prompt_token_ids or [])


def _prompt_too_long():
    from worker.engine import RejectReason

    return RejectReason.PROMPT_TOO_LONG
