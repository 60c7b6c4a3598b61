"""One job held by a worker (`LocalJob`), its lifecycle state (`JobState`, ordered), the
Kafka records it answers (`Offset`), what `JobTable.apply_outputs` took (`Applied`), and
the publisher's `Round` its drafted events are numbered into.
Only `worker.serve.jobs.JobTable` changes them (the lifecycle diagram is in
`worker/serve/jobs.py`); a job keeps its own drafts, `seq` numbers and log, and numbers
its drafted events when the table drains a round (`LocalJob.number_drafts`)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog

from schemas.codec import encode
from schemas.replay import Compactor, LogEntry, compact
from schemas.wire import ErrorInfo, Event, Finished, FinishReason, Restarted, Started, Token, TokenLogprob
from worker.serve.input_size import input_bytes

if TYPE_CHECKING:
    from worker.obs.tracing import JobTrace
    from worker.serve.claims import Claimed
    from worker.serve.read_ahead import JobRecord


log = structlog.get_logger(__name__)

RESTART_REASON = "the previous attempt did not finish (worker stopped or handed the job back)"


class JobState(enum.IntEnum):
    CLAIMED = 0  # claim held; attempt and first seq known; input being validated / tokenized
    IN_ENGINE = 1  # the engine accepted the request; opening events drafted
    FINISHING = 2  # terminal event drafted; waiting for it to be published and recorded
    DONE = 3  # published and recorded; removed from the table
    HANDED_BACK = 4  # aborted without a terminal event (drain deadline, lease lost)


@dataclass(slots=True, eq=False)
class Offset:
    """A Kafka record a job answers: (topic, partition) and offset."""

    tp: Any
    offset: int


class LocalJob:
    """One job held by this worker, opened from the Kafka record it came in and the claim
    this worker holds on it. Times are Unix seconds unless named `*_mono`. Changed only
    through JobTable. (A plain slotted class: one is made per job on the hot path.)

    A record that is not a valid job (`record.job` None) is held too, under the job id
    and tenant recovered from its bytes, only to publish its `finished(rejected)`.
    """

    __slots__ = ("job", "job_id", "tenant", "priority", "offsets", "enqueue_time", "claim_token", "attempt",
                 "next_seq", "raw", "raw_key", "isolated", "state", "claim_time", "first_token_time", "num_tokens",
                 "text_parts", "cancel_time_mono", "_opening", "_delta_text", "_delta_ids", "_delta_logprobs",
                 "_terminal", "opened", "finish_reason", "error", "dead_letter", "history", "summary",
                 "terminal_published", "prior", "trace", "headers", "input_bytes", "compactor", "charge",
                 "prompt_tokens")

    def __init__(self, record: JobRecord, claim: Claimed, claim_time: float, *, job_id: str | None = None,
                 tenant: str | None = None) -> None:
        job = record.job
        self.job = job  # None: a record that is not a job (then `job_id` is the recovered one)
        self.job_id: str = job.job_id if job is not None else job_id
        self.tenant: str | None = job.tenant if job is not None else tenant  # its stream keys carry it
        self.priority = record.priority
        self.offsets = [Offset(record.tp, record.offset)]
        self.enqueue_time = record.enqueue_time  # the Kafka record timestamp
        self.headers: tuple = record.headers  # its record's Kafka headers (trace context), kept for a re-take
        self.raw = record.raw  # the record's original bytes until the engine accepts the job (DLQ)
        self.input_bytes = input_bytes(job) if job is not None else 0  # the text its tokenizer will read
        self.raw_key = record.key
        self.claim_token = claim.token
        self.attempt = claim.attempt
        self.next_seq = claim.next_seq
        self.isolated = claim.failures > 0  # an earlier attempt died with its worker: run it alone
        self.prior = claim.prior  # earlier attempts' log entries
        self.state = JobState.CLAIMED
        self.claim_time = claim_time
        self.first_token_time: float | None = None
        self.num_tokens = 0
        self.text_parts: list[str] = []
        self.cancel_time_mono: float | None = None  # time.monotonic() of the cancel (cancel-to-free latency)
        # drafts not yet numbered (see module docstring)
        self._opening: list[str] = []  # "restarted", "started"
        self._delta_text: list[str] = []
        self._delta_ids: list[int] = []
        self._delta_logprobs: list[TokenLogprob] | None = None
        self._terminal: Finished | None = None
        self.opened = False
        self.finish_reason: FinishReason | None = None
        self.error: ErrorInfo | None = None
        self.dead_letter: tuple[str, str] | None = None  # (reason code, message): the record goes to the DLQ
        self.history: list[LogEntry] = []  # published entries of this attempt (compacted once it ended)
        self.compactor: Compactor | None = None  # this attempt's entries compacted as they are numbered
        self.summary: dict[str, Any] = {}  # timings for the job's summary log line
        self.terminal_published = False  # the terminal event is numbered (in `history`; being published)
        self.trace: JobTrace | None = None  # its trace when tracing is on and it is sampled (worker.obs.tracing)
        self.charge = record.charge  # tokens charged to its tenant's fleet rate (settled when it leaves)
        self.prompt_tokens = 0  # its prompt's tokens once the engine accepted it

    @property
    def metadata(self) -> dict[str, Any] | None:
        """The job's `metadata`, echoed in `started` and `finished`."""
        return self.job.metadata if self.job is not None else None

    def retake_records(self) -> list[JobRecord]:
        """Its records as the intake re-takes them when another worker holds the job now
        (one per offset it answers; the original bytes are gone once it ran)."""
        from worker.serve.read_ahead import JobRecord

        return [JobRecord(self.job, self.priority, o.tp, o.offset, self.enqueue_time, b"", None, headers=self.headers)
                for o in self.offsets]

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    # ---- drafts: events not numbered yet (the table numbers them when a round is drained)
    @property
    def has_drafts(self) -> bool:
        return bool(self._opening or self._delta_ids or self._delta_text or self._terminal is not None)

    def draft_opening(self, kind: str) -> None:
        """An opening event to publish: "restarted" or "started"."""
        self._opening.append(kind)

    def draft_delta(self, text: str, token_ids: list[int], logprobs: Iterable[TokenLogprob] | None) -> None:
        """New output of the engine, merged into the next token event."""
        self._delta_text.append(text)
        self._delta_ids.extend(token_ids)
        if logprobs:
            if self._delta_logprobs is None:
                self._delta_logprobs = []
            self._delta_logprobs.extend(logprobs)

    def draft_terminal(self, event: Finished) -> None:
        """The terminal event (its `seq` is set when drained)."""
        self._terminal = event

    def drop_drafts(self) -> None:
        """Forget every draft but the terminal one (a job handed back publishes nothing)."""
        self._opening.clear()
        self._delta_text.clear()
        self._delta_ids.clear()
        self._delta_logprobs = None

    def number_drafts(self, worker_id: str, rnd: Round) -> None:
        """Number the drafted events into the publisher's round `rnd`, in publishing
        order (opening, one merged token event, terminal), from `next_seq` on; each one's
        log entry goes to `history` (and the compactor). With log compaction on, the
        job's compacted log (without the terminal event) goes to `rnd.compacted` when its
        terminal event is among them (`schemas.replay`), and the job to `rnd.finished`.
        `worker_id` goes into `started`."""
        drafts = self.take_drafts()
        for kind in drafts.opening:
            if kind == "restarted":
                ev: Event = Restarted(job_id=self.job_id, seq=self.next_seq, attempt=self.attempt,
                                      reason=RESTART_REASON)
            else:
                ev = Started(job_id=self.job_id, seq=self.next_seq, attempt=self.attempt, worker_id=worker_id,
                             queue_time_s=max(0.0, self.claim_time - self.enqueue_time), metadata=self.metadata)
            self._number(ev, rnd)
        if drafts.text is not None:
            ev = Token(job_id=self.job_id, seq=self.next_seq, attempt=self.attempt, text=drafts.text,
                       token_ids=drafts.token_ids, logprobs=drafts.logprobs)
            self._number(ev, rnd)
        if drafts.terminal is None:
            return
        if self.compactor is not None and self.history:
            rnd.compacted[self.job_id] = self._compact()
        drafts.terminal.seq = self.next_seq
        self._number(drafts.terminal, rnd)
        self.terminal_published = True
        rnd.finished.append(self)

    def _number(self, ev: Event, rnd: Round) -> None:
        data = encode(ev)
        rnd.events.append(ev)
        rnd.encoded.append(data)
        rnd.tenants.append(self.tenant)
        rnd.tokens.append(self.claim_token)
        entry = LogEntry(ev.seq, self.attempt, data)
        self.history.append(entry)
        if self.compactor is not None:
            self.compactor.add(entry, ev)
        self.next_seq += 1

    def _compact(self) -> list[LogEntry]:
        """The job's log compacted, its terminal event not yet in it: the earlier attempts'
        entries and this attempt's (compacted as they were numbered), each apart. What the
        worker keeps to restore the log after a Redis data loss becomes that too."""
        try:
            prior = compact(self.prior)
        except Exception as e:  # an earlier attempt's entry that does not decode: kept as it is
            log.warning("could not compact an earlier attempt's log entries", job_id=self.job_id, error=repr(e)[:200])
            prior = list(self.prior)
        own = self.compactor.finish()
        self.prior, self.history, self.compactor = tuple(prior), own, None
        return [*prior, *own]

    def take_drafts(self) -> Drafts:
        """The drafts, in publishing order, and forget them."""
        has_delta = bool(self._delta_ids or self._delta_text)
        drafts = Drafts(self._opening, "".join(self._delta_text) if has_delta else None, self._delta_ids,
                        self._delta_logprobs, self._terminal)
        if has_delta:
            self._delta_text, self._delta_ids, self._delta_logprobs = [], [], None
        self._opening = []
        self._terminal = None
        return drafts


@dataclass(slots=True)
class Round:
    """One publisher round: numbered events in publish order, and the jobs whose
    terminal event is among them. `encoded[i]` is `events[i]` as wire bytes,
    `tenants[i]` the tenant of its job (None: all events are of jobs without one) and
    `tokens[i]` its claim token (the append script refuses events of jobs whose claim is
    another worker's)."""

    events: list[Event]
    encoded: list[bytes]
    finished: list[LocalJob]
    tenants: list[str | None] | None = None
    tokens: list[str] | None = None  # the claim token of each event's job (None: no claims, tests)
    # per job ending in this round (log compaction on): its log as it is to be rewritten,
    # without the terminal event (`schemas.replay`); the publisher writes it with the end
    compacted: dict[str, list[LogEntry]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.events)


class Drafts(NamedTuple):
    """A job's drafted events: opening kinds, then one merged token event (`text` None if
    there is none), then the terminal event."""

    opening: list[str]
    text: str | None
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    terminal: Finished | None


@dataclass(slots=True)
class Applied:
    """What `apply_outputs` took: jobs whose first token arrived (for TTFT), the number
    of output tokens drafted (outputs of jobs no longer here are not counted), and that
    number per tenant (`""`: jobs without one)."""

    first_tokens: list[LocalJob]
    num_tokens: int
    tokens_by_tenant: dict[str, int] = field(default_factory=dict)
