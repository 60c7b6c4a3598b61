"""The worker's job table: every job this process holds, its lifecycle, and the events
each one owes its stream. The table is the only writer of a job's state and of its
`seq` numbers; it does no I/O, so the whole lifecycle is tested without Kafka or Redis.

Lifecycle of one local job (an ordered enum; each arrow is one JobTable method):

    open ──► CLAIMED ──accepted / first output──► IN_ENGINE ──terminal output──► FINISHING
                │                                      │                             │
                └──finish_local (cancelled before      │                      published
                   running, expired, rejected, poison) ─┴──────────► FINISHING ──► DONE
                                                        hand_back ──► HANDED_BACK (no terminal event)

Events are drafted per job as engine outputs arrive (`apply_outputs`) and numbered only
when the publisher takes a round (`drain`): the opening events (`restarted` on a later
attempt, then `started` once the engine accepted the job), at most one `token` event
holding every token that arrived since the last round (token coalescing: a publisher
that falls behind sends fewer, larger deltas; the concatenated text is unchanged, as
vLLM's `stream_interval`), and the terminal `finished`. Exactly one terminal event per
job; nothing after it, nothing for a job handed back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import structlog

from schemas.output_formats import read_answer
from schemas.replay import Compactor, LogEntry
from schemas.wire import (
    ErrorInfo,
    Finished,
    FinishReason,
    Timings,
    TokenLogprob,
    ToolCall,
    ToolCallFunction,
    Usage,
)
from worker.serve.history import Published, RecentHistories
from worker.serve.local_job import Applied, JobState, LocalJob, Offset, Round

if TYPE_CHECKING:
    from worker.engine import RequestOutput
    from worker.serve.claims import Claimed
    from worker.serve.read_ahead import JobRecord

log = structlog.get_logger(__name__)

class JobTable:
    """Every job this worker holds, by job id. Args:
    worker_id: written into `started` events.
    clock: wall clock (seconds), replaceable in tests.
    compact_logs: when a job ends, its log is rewritten compacted with the terminal event
        (`redis.compact_logs`; `schemas.replay`).
    """

    def __init__(self, worker_id: str, clock=time.time, *, compact_logs: bool = True) -> None:
        self.worker_id = worker_id
        self._clock = clock
        self.compact_logs = compact_logs
        self._jobs: dict[str, LocalJob] = {}
        self._per_tenant: dict[str, int] = {}  # CLAIMED or IN_ENGINE jobs per tenant ("" for none)
        self._num_unfinished = 0  # CLAIMED or IN_ENGINE jobs
        self._dirty: dict[str, LocalJob] = {}  # jobs with drafts, in the order they got them
        self._recent = RecentHistories(clock)  # what was published for jobs finished lately
        # (tool call, reasoning) families of the model's chat template, for jobs with
        # `parse_output` (set by the worker once the engine's tokenizer is loaded)
        self.output_formats: tuple[str | None, str | None] = (None, None)
        # called with each job that carries a fleet-rate charge when it stops counting as
        # held (ended or handed back): the worker settles the charge (fleet_quota.py)
        self.on_release: Callable[[LocalJob], None] | None = None

    # ---- queries ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._jobs

    def get(self, job_id: str) -> LocalJob | None:
        return self._jobs.get(job_id)

    def held_by_tenant(self) -> dict[str, int]:
        """Jobs per tenant (`""`: jobs without one) that have not reached their terminal
        event (CLAIMED or IN_ENGINE: being prepared or in the engine); a tenant with none
        is absent. A finishing job, only waiting for its last writes, no longer counts,
        so a tenant of short jobs is not under-represented in the engine. Read-only view."""
        return self._per_tenant

    @property
    def num_unfinished(self) -> int:
        """Jobs that have not reached their terminal event (CLAIMED or IN_ENGINE): what
        `worker.max_local_jobs` bounds. The rest of the table is FINISHING."""
        return self._num_unfinished

    def __iter__(self) -> Iterator[LocalJob]:
        return iter(list(self._jobs.values()))

    def holding_claims(self) -> list[LocalJob]:
        """Jobs whose claim this worker must keep renewing."""
        return [j for j in self._jobs.values() if j.state in (JobState.CLAIMED, JobState.IN_ENGINE,
                                                               JobState.FINISHING)]

    def running(self) -> list[LocalJob]:
        """Jobs that have not reached their terminal event yet."""
        return [j for j in self._jobs.values() if j.state in (JobState.CLAIMED, JobState.IN_ENGINE)]

    @property
    def has_drafts(self) -> bool:
        return bool(self._dirty)

    @property
    def num_drafted(self) -> int:
        """Jobs with events waiting for the next round."""
        return len(self._dirty)

    # ---- transitions -----------------------------------------------------------------
    def open(self, record: JobRecord, claim: Claimed) -> LocalJob | None:
        """The job of `record`, claimed by this worker (`claim`): CLAIMED. The claim's
        `next_seq` continues the job's log; its `prior` entries (earlier attempts) are kept
        for a restore. None when the job is held here already (another record of it in
        the same batch): the record's offset is attached to it instead, answered by the
        same terminal event."""
        if self.attach_offset(record.job.job_id, Offset(record.tp, record.offset)):
            return None
        return self._hold(LocalJob(record, claim, self._clock()))

    def open_rejected(self, record: JobRecord, claim: Claimed, job_id: str, tenant: str | None) -> LocalJob:
        """A record that is not a valid job, held under the job id (and tenant) recovered
        from its bytes only to end it: `finish_local(REJECTED)` follows at once.

        Raises:
            ValueError: a job with that id is already held here.
        """
        return self._hold(LocalJob(record, claim, self._clock(), job_id=job_id, tenant=tenant))

    def _hold(self, held: LocalJob) -> LocalJob:
        if held.job_id in self._jobs:
            raise ValueError(f"job {held.job_id!r} is already held by this worker")
        self._jobs[held.job_id] = held
        if self.compact_logs:
            held.compactor = Compactor()
        tenant = held.tenant or ""
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        self._num_unfinished += 1
        if held.attempt > 1:
            self._draft(held, opening="restarted")
        return held

    def attach_offset(self, job_id: str, offset: Offset) -> bool:
        """A redelivered record of a job held here: it is answered by the same terminal
        event. False if the job is not here."""
        held = self._jobs.get(job_id)
        if held is None:
            return False
        held.offsets.append(offset)
        return True

    def accepted(self, job_id: str) -> None:
        """The engine accepted the request: IN_ENGINE, `started` drafted (once; the
        engine's first output may have done it already)."""
        held = self._jobs.get(job_id)
        if held is not None and held.state == JobState.CLAIMED:
            self._enter_engine(held)

    def _enter_engine(self, held: LocalJob) -> None:
        held.state = JobState.IN_ENGINE
        held.raw = held.raw_key = None
        self._draft(held, opening="started")

    def finish_local(self, job_id: str, reason: FinishReason, error: ErrorInfo | None = None,
                     dead_letter: tuple[str, str] | None = None) -> LocalJob | None:
        """End a job that never ran in the engine (cancelled before it started, expired,
        rejected, poison): only its terminal event (after `restarted` on a later attempt)."""
        held = self._jobs.get(job_id)
        if held is None or held.state != JobState.CLAIMED:
            return None
        held.dead_letter = dead_letter
        self._terminate(held, reason, error, usage=Usage(prompt_tokens=0, completion_tokens=0), timings=None)
        return held

    def disown(self, job_id: str) -> LocalJob | None:
        """Another worker holds the job now (its claim was lost): like `hand_back`, and
        also for a FINISHING job, whose terminal event is then never published or
        recorded here. None if the job is not here."""
        held = self._jobs.get(job_id)
        if held is None or held.state != JobState.FINISHING:
            return self.hand_back(job_id)
        held.state = JobState.HANDED_BACK
        held.drop_drafts()
        held.take_drafts()  # the terminal draft too
        self._dirty.pop(held.job_id, None)
        del self._jobs[held.job_id]
        if held.trace is not None:
            held.trace.end(self._clock(), "lost")
        return held

    def hand_back(self, job_id: str) -> LocalJob | None:
        """Give the job up without a terminal event (its drafts are dropped); the caller
        aborts it in the engine and releases its claim. None if it already has its
        terminal event (then it finishes normally) or is unknown."""
        held = self._jobs.get(job_id)
        if held is None or held.state not in (JobState.CLAIMED, JobState.IN_ENGINE):
            return None
        held.state = JobState.HANDED_BACK
        held.drop_drafts()
        self._dirty.pop(held.job_id, None)
        self._untrack(held)
        del self._jobs[held.job_id]
        if held.trace is not None:
            held.trace.end(self._clock(), "handed_back")
        return held

    def request_cancel(self, job_id: str, now_mono: float | None = None) -> LocalJob | None:
        """A cancel arrived for a job held here: note its time (the first one counts) and
        return the job if it has not reached its terminal event (the caller aborts it in
        the engine when IN_ENGINE; a CLAIMED job is aborted as soon as it is accepted)."""
        held = self._jobs.get(job_id)
        if held is None or held.state not in (JobState.CLAIMED, JobState.IN_ENGINE):
            return None
        if held.cancel_time_mono is None:
            held.cancel_time_mono = time.monotonic() if now_mono is None else now_mono
        return held

    def apply_outputs(self, outputs: Iterable[RequestOutput]) -> Applied:
        """Draft the events of engine outputs (a step's, or several steps' merged).
        Outputs of jobs not here, handed back or already finishing are ignored."""
        now = self._clock()
        first_tokens = []
        num_tokens = 0
        by_tenant: dict[str, int] = {}
        for out in outputs:
            held = self._jobs.get(out.request_id)
            if held is None or held.state not in (JobState.CLAIMED, JobState.IN_ENGINE):
                continue
            if held.state == JobState.CLAIMED:  # the output overtook `accepted`
                self._enter_engine(held)
            if out.new_token_ids or out.text:
                if held.first_token_time is None:
                    held.first_token_time = now
                    first_tokens.append(held)
                held.num_tokens += len(out.new_token_ids)
                num_tokens += len(out.new_token_ids)
                tenant = held.tenant or ""
                by_tenant[tenant] = by_tenant.get(tenant, 0) + len(out.new_token_ids)
                held.text_parts.append(out.text)
                held.draft_delta(out.text, out.new_token_ids, [
                    TokenLogprob(token_id=x.token_id, logprob=x.logprob, top_token_ids=x.top_token_ids,
                                 top_logprobs=x.top_logprobs) for x in out.logprobs] if out.logprobs else None)
                self._dirty.setdefault(held.job_id, held)
            if out.finished:
                self._finish_from_engine(held, out, now)
        return Applied(first_tokens, num_tokens, by_tenant)

    def _finish_from_engine(self, held: LocalJob, out: RequestOutput, now: float) -> None:
        reason = FinishReason(out.finish_reason or "error")
        e2e = now - held.enqueue_time
        first = held.first_token_time
        ttft = first - held.enqueue_time if first is not None else None
        tpot = (now - first) / (held.num_tokens - 1) if first is not None and held.num_tokens > 1 else None
        queue = out.times.queue_s if out.times is not None else None
        u = out.usage
        usage = Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                      cached_prompt_tokens=u.cached_prompt_tokens) if u is not None else None
        error = ErrorInfo(code=out.error_code, message=out.error_message or "") if out.error_code else None
        held.summary = {
            "queue_s": _round(queue), "ttft_s": _round(ttft), "tpot_s": _round(tpot), "e2e_s": _round(e2e),
            "tokens_per_s": _round(held.num_tokens / (now - first)) if first is not None and now > first else None,
            "prompt_tokens": u.prompt_tokens if u else None,
            "cached_prompt_tokens": u.cached_prompt_tokens if u else None,
            "preemptions": out.num_preemptions,
        }
        if error is not None:
            held.summary["error_code"] = error.code
        if held.trace is not None:
            held.trace.engine_done(out.times)
        self._terminate(held, reason, error, usage, Timings(queue_s=queue, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e))

    def _terminate(self, held: LocalJob, reason: FinishReason, error: ErrorInfo | None, usage: Usage | None,
                   timings: Timings | None) -> None:
        self._untrack(held)
        held.state = JobState.FINISHING
        held.finish_reason = reason
        held.error = error
        # seq is set when the round is drained
        term = Finished(job_id=held.job_id, seq=-1, attempt=held.attempt, finish_reason=reason, text=held.text,
                        usage=usage, timings=timings, error=error, metadata=held.metadata,
                        **self._read_output(held, reason))
        held.draft_terminal(term)
        self._dirty.setdefault(held.job_id, held)
        if held.trace is not None:
            held.trace.terminated(held, term, self._clock())

    def _read_output(self, held: LocalJob, reason: FinishReason) -> dict:
        """`content`, `reasoning`, `tool_calls` of a finished event whose job asked for
        them (`parse_output`); {} otherwise."""
        job = held.job
        if job is None or not job.parse_output or not reason.is_success:
            return {}
        tool, think = self.output_formats
        try:
            read = read_answer(held.text, tool if job.tools else None, think)
        except Exception as e:  # a parser bug costs the reading, never the job or the worker
            log.warning("could not read a finished job's output (parse_output)", job_id=held.job_id, error=repr(e))
            return {}
        calls = [ToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
                 for c in read.calls] or None
        return {"content": read.content, "reasoning": read.reasoning, "tool_calls": calls}

    def _draft(self, held: LocalJob, *, opening: str) -> None:
        if opening == "started":
            if held.opened:
                return
            held.opened = True
        held.draft_opening(opening)
        self._dirty.setdefault(held.job_id, held)

    # ---- rounds ----------------------------------------------------------------------
    def drain(self) -> Round:
        """Number every drafted event (per job: opening, one merged token event,
        terminal; `LocalJob.number_drafts`) and hand them to the publisher as one round."""
        rnd = Round([], [], [], [], [], {})
        dirty, self._dirty = self._dirty, {}
        for held in dirty.values():
            held.number_drafts(self.worker_id, rnd)
        return rnd

    def done(self, held: LocalJob) -> None:
        """The job's terminal event is published and recorded: DONE, out of the table.
        Its published history is kept a while (`histories`)."""
        held.state = JobState.DONE
        if held.history and held.finish_reason is not None:
            self._recent.add(held.job_id, Published(self._clock(), held.history, held.finish_reason.value,
                                                    held.claim_token, held.attempt, held.tenant, held.prior))
        held.history = []
        if self._jobs.get(held.job_id) is held:
            del self._jobs[held.job_id]

    def _untrack(self, held: LocalJob) -> None:
        """The job leaves CLAIMED / IN_ENGINE: it no longer counts in `held_by_tenant`
        nor in `num_unfinished`."""
        _decrement(self._per_tenant, held.tenant or "")
        self._num_unfinished -= 1
        if held.charge and self.on_release is not None:
            self.on_release(held)

    def histories(self) -> Iterator[tuple[str, int, str, list[LogEntry], str | None, tuple[LogEntry, ...]]]:
        """What Redis must hold of the jobs this worker holds and of each job it finished
        in the last RECENT_MAX_AGE_S: (job_id, attempt, claim token, the log entries it
        published (compacted once the job ended, with log compaction on), finish reason,
        the earlier attempts' entries it found at its claim); the finish reason is None
        unless the history ends with the job's terminal event."""
        for held in self._jobs.values():
            if held.history or held.prior:
                reason = held.finish_reason.value if held.terminal_published and held.finish_reason else None
                yield held.job_id, held.attempt, held.claim_token, list(held.history), reason, held.prior
        for job_id, pub in self._recent.items():
            if job_id not in self._jobs:
                yield job_id, pub.attempt, pub.claim_token, pub.history, pub.reason, pub.prior

    def tenant_of(self, job_id: str) -> str | None:
        """The tenant of a held or recently finished job (None: none, or unknown)."""
        held = self._jobs.get(job_id)
        if held is not None:
            return held.tenant
        recent = self._recent.get(job_id)
        return recent.tenant if recent is not None else None


def _decrement(counts: dict[str, int], key: str) -> None:
    n = counts[key] - 1
    if n:
        counts[key] = n
    else:
        del counts[key]


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)
