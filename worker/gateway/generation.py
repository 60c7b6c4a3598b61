"""One interactive request's job, from submit to its terminal event (or to the cancel
that ends it when the request is abandoned).

    submit ──► wait for the first token or the end ──► deltas … ──► finished
       │            │ deadline + grace passed: cancel, 429          │
       │            │ finished(expired): 429                         │
       └── the handler leaves early (client gone, timeout): cancel ──┘

The job's `deadline` is `now + gateway.queue_timeout_s`, so a worker that reaches the
job later drops it as `expired` too. A worker may die mid-job; its job then restarts
elsewhere from scratch (`restarted`). Every job the gateway submits carries a seed (the
client's, else a random one), so the new attempt reproduces the same tokens: the text
already delivered is checked against the new attempt and only what follows it is passed
on (a mismatch ends the request with an error instead of duplicated text).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import structlog
from aiokafka.errors import KafkaError

from schemas.wire import Event, Finished, Job, Restarted, Started, Token, TokenLogprob
from worker.client import InflightClient
from worker.gateway.errors import ApiError, overloaded
from worker.obs.errors import suppressed
from worker.security.access import AccessError

log = structlog.get_logger(__name__)

START_GRACE_S = 1.0  # past the deadline, how long to wait for the worker's own `expired`


def seeded(job: Job) -> Job:
    """`job` with a random seed when it has none (restarts then reproduce its tokens)."""
    if job.params.seed is not None:
        return job
    return msgspec.structs.replace(job, params=msgspec.structs.replace(job.params, seed=secrets.randbits(31)))


class Delta(msgspec.Struct):
    """New text for the client, the number of new tokens it came with, and their
    logprobs (when asked for)."""

    text: str
    num_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


class Generation:
    """One interactive request's job, from submit to its terminal event (or the cancel that ends it).

    Args:
        client: the gateway's InflightClient (Kafka producer, Redis streams).
        job: the job to run (with `deadline` set, `seeded`).
        priority: its priority class (topic).
        request_timeout_s: the whole request's bound (the stream gives up after it).
        retry_after_s: `Retry-After` of a 429.
        cancels: sends this job's cancel if the request ends before the job.
        check_pool: called with the pool the job routes to before it is produced; what it
            raises (the gateway's 503 for a pool with no live worker) ends the request with
            nothing produced.
    """

    def __init__(self, client: InflightClient, job: Job, priority: str, *, request_timeout_s: float,
                 retry_after_s: int, cancels: CancelSender, check_pool: Callable[[str], None] | None = None) -> None:
        self.client = client
        self._check_pool = check_pool
        self.job = job
        self.priority = priority
        self.retry_after_s = retry_after_s
        self._cancels = cancels
        self._events = client.stream(job.job_id, tenant=job.tenant, timeout_s=request_timeout_s)
        self._submitted = False
        self.finished: Finished | None = None
        self._sent_text = ""  # delivered to the client so far
        self._sent_tokens = 0
        self._attempt_text = ""  # text of the current attempt
        self._attempt_tokens = 0
        self._pending: Event | None = None
        self.cancel_reason: str | None = None  # why a cancel is sent if the request ends first
        self.submit_s = 0.0  # the Kafka produce, seconds
        self.first_event_s = 0.0  # start() to the first token or the end, seconds

    @property
    def job_id(self) -> str:
        return self.job.job_id

    async def _next(self) -> Event:
        return await anext(self._events)

    async def start(self) -> None:
        """Submit the job and wait until it yields its first token or ends.

        Raises:
            ApiError: 429 with `Retry-After` when it did not start before its deadline
                (the cancel is sent); 503 when Kafka does not take the job, or what
                `check_pool` raises (nothing produced).
        """
        t0 = time.perf_counter()
        pool = self.client.pool_of(self.job)
        if self._check_pool is not None:
            self._check_pool(pool)  # before anything is subscribed or produced
        first = asyncio.ensure_future(self._next())  # subscribes while the job is produced
        try:
            self._submitted = True
            await self.client.submit_job(self.job, self.priority, pool=pool)
            self.submit_s = time.perf_counter() - t0
        except (KafkaError, AccessError, OSError) as e:
            first.cancel()
            await asyncio.wait({first})
            raise ApiError(503, f"could not queue the request: {type(e).__name__}", code="queue_unavailable") from None
        except BaseException:
            first.cancel()
            raise
        wait_s = max(0.0, (self.job.deadline or time.time()) - time.time()) + START_GRACE_S
        try:
            async with asyncio.timeout(wait_s):
                ev = await first
            while isinstance(ev, Started | Restarted):  # in an engine: its own deadline check ends it
                ev = await self._next()
        except TimeoutError:
            raise overloaded(self.retry_after_s, "no worker started the request within its queue timeout "
                             "(gateway.queue_timeout_s); retry later") from None
        self._pending = ev
        self.first_event_s = time.perf_counter() - t0
        if isinstance(ev, Finished):
            self.finished = ev

    def server_timing(self) -> str:
        """`Server-Timing` header value: the Kafka produce and the wait from submit to the
        job's first token (or end), milliseconds."""
        return f"submit;dur={self.submit_s * 1e3:.1f}, first_token;dur={self.first_event_s * 1e3:.1f}"

    async def deltas(self) -> AsyncIterator[Delta]:
        """New text of the job until it ends (then `finished` is set). Call after `start`.

        Raises:
            TimeoutError: no end within the request timeout.
            ApiError: 500 when a restarted attempt diverged from the delivered text.
        """
        while True:
            ev = self._pending or await self._next()
            self._pending = None
            if isinstance(ev, Restarted):
                self._attempt_text, self._attempt_tokens = "", 0
            elif isinstance(ev, Token):
                delta = self._take(ev.text, ev.logprobs, len(ev.token_ids))
                if delta is not None:
                    yield delta
            elif isinstance(ev, Finished):
                self.finished = ev
                if ev.finish_reason.is_success and len(ev.text) > len(self._sent_text):
                    rest = self._take(ev.text[len(self._attempt_text):], None, 0)  # e.g. read from the results topic
                    if rest is not None:
                        yield rest
                return

    def _take(self, text: str, logprobs: list[TokenLogprob] | None, num_tokens: int) -> Delta | None:
        """The part of a token event not delivered yet (all of it, except while a
        restarted attempt replays what the client already has)."""
        start_tok = self._attempt_tokens
        checked = len(self._attempt_text)  # the attempt's text before this event was compared already
        self._attempt_text += text
        self._attempt_tokens += num_tokens
        attempt, sent = self._attempt_text, self._sent_text
        common = min(len(attempt), len(sent))
        if checked < common and attempt[checked:common] != sent[checked:common]:
            raise ApiError(500, "the request was restarted on another worker and produced different text",
                           code="restart_diverged")
        new_text = attempt[len(sent):]
        if new_text:
            self._sent_text = attempt
        new_tokens = max(0, self._attempt_tokens - self._sent_tokens)
        new_lp = logprobs[max(0, self._sent_tokens - start_tok):] if logprobs is not None and new_tokens else None
        self._sent_tokens += new_tokens
        if not new_text and not new_tokens:
            return None
        return Delta(new_text, new_tokens, new_lp)

    async def close(self, reason: str) -> None:
        """End the request: if its job may still run, have the cancel sent (in the
        background: the caller may be a cancelled task); always release the stream."""
        if self._submitted and self.finished is None:
            self._cancels.send(self.job_id, reason)
        with suppressed(log, "closing the job's event stream"):
            await self._events.aclose()


class CancelSender:
    """Sends cancel messages in background tasks, so a handler being cancelled (its
    client went away) still gets its job cancelled at once.

    Args:
        client: the InflightClient (tombstone in Redis where allowed + cancel message).
        on_send: called with the reason of each cancel (metrics).
    """

    def __init__(self, client: InflightClient, on_send: Callable[[str], None] | None = None) -> None:
        self.client = client
        self._on_send = on_send
        self._tasks: set[asyncio.Task] = set()

    def send(self, job_id: str, reason: str) -> None:
        if self._on_send is not None:
            self._on_send(reason)
        task = asyncio.get_running_loop().create_task(self._cancel(job_id, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _cancel(self, job_id: str, reason: str) -> None:
        try:
            await self.client.cancel(job_id, reason=reason)
        except Exception as e:  # Kafka down: the job's deadline still stops it
            log.warning("could not send a cancel", job_id=job_id, reason=reason, error=repr(e)[:200])

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) for cancels still being sent (at shutdown)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
