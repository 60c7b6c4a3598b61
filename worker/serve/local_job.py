"""One job held by a worker (`LocalJob`), its lifecycle state (`JobState`, ordered), the
Kafka records it answers (`Offset`), and what `JobTable.apply_outputs` took (`Applied`).
Only `worker.serve.jobs.JobTable` writes them; the lifecycle diagram is in
`worker/serve/jobs.py`."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from schemas.wire import ErrorInfo, Finished, FinishReason, Job, TokenLogprob

if TYPE_CHECKING:
    from worker.obs.tracing import JobTrace


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
    """One job held by this worker. Times are Unix seconds unless named `*_mono`.
    Written only by JobTable. (A plain slotted class: one is made per job on the hot path.)"""

    __slots__ = ("job", "priority", "offsets", "enqueue_time", "claim_token", "attempt", "next_seq", "raw", "raw_key",
                 "isolated", "state", "claim_time", "first_token_time", "num_tokens", "text_parts",
                 "cancel_time_mono", "_opening", "_delta_text", "_delta_ids", "_delta_logprobs", "_terminal",
                 "opened", "finish_reason", "error", "dead_letter", "history", "summary", "terminal_published", "prior",
                 "trace", "headers")

    def __init__(self, job: Job, priority: str, offsets: list[Offset], enqueue_time: float, claim_token: str,
                 attempt: int, next_seq: int, raw: bytes | None = None, raw_key: bytes | None = None,
                 isolated: bool = False, claim_time: float = 0.0) -> None:
        self.job = job
        self.priority = priority
        self.offsets = offsets
        self.enqueue_time = enqueue_time  # the Kafka record timestamp
        self.claim_token = claim_token
        self.attempt = attempt
        self.next_seq = next_seq
        self.raw = raw  # the record's original bytes until the engine accepts the job (DLQ)
        self.raw_key = raw_key
        self.isolated = isolated  # an earlier attempt died with its worker: run it alone
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
        self.history: list[tuple[int, bytes]] = []  # published (seq, event) of this attempt
        self.summary: dict[str, Any] = {}  # timings for the job's summary log line
        self.terminal_published = False  # the terminal event is numbered (in `history`; being published)
        self.prior: tuple[tuple[int, int, bytes], ...] = ()  # earlier attempts' log entries (seq, attempt, event)
        self.trace: JobTrace | None = None  # its trace when tracing is on and it is sampled (worker.obs.tracing)
        self.headers: tuple = ()  # its record's Kafka headers (trace context), kept for a re-take

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def tenant(self) -> str | None:
        """The job's tenant: its stream keys carry it (`schemas.keys`)."""
        return self.job.tenant

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
