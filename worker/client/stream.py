"""One job's event stream as a client reads it (`InflightClient.stream`): every event
once, in `seq` order, ending with `finished`, from the job's live channel and its replay
log together:

    subscribe ──► read the log (seq > last) ──► wait for a live message ──┐
        ▲             ▲   │ yields new events                           │
        │             │   └── finished: end                             │
        │             └── a gap in seq, a quiet poll, a reconnect ◄─────┘
        └── Redis down: back off, resubscribe (SharedSubscriber), read the log again

A late subscriber loses nothing (the log holds every event); a message lost on a
broken connection is found in the log. With the results fallback, a job whose log stays
empty (a Redis that restarted empty lost it) is looked up in the durable results topic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from redis.exceptions import NoPermissionError

from schemas import keys
from schemas.codec import decode_event
from schemas.wire import Event, Finished, check_tenant
from worker.client.subscriber import RESYNC, Denied, SharedSubscriber
from worker.security import access
from worker.security.redis import REDIS_DOWN

if TYPE_CHECKING:
    from worker.config import RedisConfig

log = logging.getLogger(__name__)

LOOKUP_EVERY_S = 10.0  # after the first results lookup, how often to look again, seconds
MAX_QUIET_POLL_S = 8.0  # the longest quiet wait before the log is read again, seconds


class StreamSource(Protocol):
    """What a stream reads through (`worker.client.inflight.InflightClient`)."""

    key_prefix: str
    redis_config: RedisConfig
    reconnect_s: float  # how long Redis may stay down when no timeout bounds the stream, seconds
    results_fallback_s: float  # an empty log for this long: look in the results topic, seconds
    subscriber: SharedSubscriber
    results_denied: bool  # this principal may not read the results topic (learned once)

    async def read_log(self, job_id: str, after_seq: int = -1, *, tenant: str | None = None) -> list[Event]: ...

    async def lookup_results(self, job_ids: list[str], timeout_s: float = 30.0) -> dict[str, Finished]: ...


class JobStream:
    """The state of one stream: the last seq yielded, the deadline, the Redis outage
    under way, when to look in the results topic next.

    Args:
        source: the client it reads through.
        job_id, tenant: the job (a job submitted with a tenant streams on its keys).
        timeout_s: the whole stream's bound (None: none), seconds.
        poll_s: a quiet wait this long re-reads the log (a live message may be lost);
            each further quiet wait doubles, up to `MAX_QUIET_POLL_S` (never past the
            deadline or the next results lookup), back to `poll_s` once an event arrives
            live or a read of the log finds events the live channel did not bring.
            So the open streams of jobs waiting in a deep queue cost Redis and their
            reader a few log reads each, not one a second.
        fallback: look the job up in the results topic while its log stays empty.

    """

    def __init__(self, source: StreamSource, job_id: str, *, tenant: str | None, timeout_s: float | None,
                 poll_s: float, fallback: bool) -> None:
        self.source = source
        self.job_id = job_id
        self.tenant = tenant
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.fallback = fallback
        started = time.monotonic()
        self.deadline = None if timeout_s is None else started + timeout_s
        self.next_lookup = started + source.results_fallback_s
        self.last = -1  # the last seq yielded
        self._down_since: float | None = None
        self._delay = 0.05
        self._quiet_s = poll_s  # the next quiet wait (doubles while quiet)

    async def events(self) -> AsyncIterator[Event]:
        """The job's events, each once, in seq order, ending with `finished` (raises as
        `InflightClient.stream`)."""
        src = self.source
        self.tenant = check_tenant(self.tenant)
        channel = keys.channel(self.job_id, src.key_prefix, self.tenant).encode()
        try:
            queue = await src.subscriber.add(channel)
        except NoPermissionError as e:
            raise access.explain_redis(e, src.redis_config) from None
        try:
            pending = await self._read_log()  # after subscribing: no gap
            while True:
                for ev in pending:
                    if ev.seq > self.last:
                        self.last = ev.seq
                        yield ev
                        if isinstance(ev, Finished):
                            return
                if self.deadline is not None and time.monotonic() > self.deadline:
                    raise TimeoutError(f"job {self.job_id} did not finish within {self.timeout_s} s")
                if (found := await self._recorded_outcome()) is not None:
                    yield found
                    return
                pending = await self._next(queue)
        finally:
            await src.subscriber.remove(channel, queue)

    async def _next(self, queue: asyncio.Queue) -> list[Event]:
        """The next live event, or the log's new events after a quiet poll, a gap in seq
        or a reconnect."""
        try:
            async with asyncio.timeout(self._quiet_wait_s()):
                data = await queue.get()
            self._quiet_s = self.poll_s
        except TimeoutError:  # quiet: check the log in case a live message was lost
            data = RESYNC
            self._quiet_s = min(self._quiet_s * 2, max(MAX_QUIET_POLL_S, self.poll_s))
        if isinstance(data, Denied):
            raise access.explain_redis(data.error, self.source.redis_config) from None
        if data is not RESYNC:
            ev = decode_event(data)
            if ev.seq <= self.last + 1:
                return [ev]
        found = await self._read_log()  # RESYNC, or a gap: fill it from the log
        if any(ev.seq > self.last for ev in found):
            self._quiet_s = self.poll_s  # events the live channel did not bring: it may be broken, look again soon
        return found

    def _quiet_wait_s(self) -> float:
        """How long the next wait for a live message may last before the log is read:
        the quiet wait, cut at the deadline and, while the results fallback may look,
        at its next lookup (both are checked when the wait ends), seconds."""
        wait = self._quiet_s
        now = time.monotonic()
        if self.deadline is not None:
            wait = min(wait, max(0.0, self.deadline - now))
        if self.fallback and self.last < 0 and not self.source.results_denied:
            wait = min(wait, max(0.0, self.next_lookup - now))
        return wait

    async def _read_log(self) -> list[Event]:
        """The log's events after the last yielded, retrying while Redis is down (with
        backoff, until the deadline, or `reconnect_s` of continuous failure)."""
        while True:
            try:
                evs = await self.source.read_log(self.job_id, self.last, tenant=self.tenant)
                self._down_since, self._delay = None, 0.05
                return evs
            except REDIS_DOWN as e:
                if access.is_fatal_redis(e):  # refused, not down: retrying cannot help
                    raise access.explain_redis(e, self.source.redis_config) or e from None
                now = time.monotonic()
                self._down_since = self._down_since or now
                if self.deadline is not None and now > self.deadline:
                    raise TimeoutError(
                        f"job {self.job_id} did not finish within {self.timeout_s} s (Redis unreachable)") from None
                if self.deadline is None and now - self._down_since > self.source.reconnect_s:
                    raise
                await asyncio.sleep(self._delay)
                self._delay = min(self._delay * 2, 1.0)

    async def _recorded_outcome(self) -> Finished | None:
        """With the fallback, while nothing was yielded: the job's outcome from the results
        topic once its log stayed empty for `results_fallback_s`, then every 10 s."""
        src = self.source
        now = time.monotonic()
        if not self.fallback or self.last >= 0 or now < self.next_lookup or src.results_denied:
            return None
        self.next_lookup = now + LOOKUP_EVERY_S
        try:
            found = await src.lookup_results([self.job_id])
        except access.AccessError as e:
            if e.exit_code != access.EXIT_AUTHORIZATION:
                raise
            src.results_denied = True  # this principal may not read outcomes: Redis only
            log.warning("results fallback disabled: %s", e)
            return None
        return found.get(self.job_id)
