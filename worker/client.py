"""Producer / consumer helpers: submit jobs, stream their events, cancel them.

Imports neither torch nor engine code (`pip install "inflight-worker[client]"`).

`stream()` subscribes to the job's channel first, then replays the job's log, so no
event is missed between the two; it dedupes by `seq`, survives late subscription
(the log keeps the whole sequence for its TTL), retries connection errors with backoff
(a Redis restart), re-reads the log from the last seq after a reconnect, and passes
`restarted` through (the caller drops earlier partial text). `result()` falls back to
the durable results topic when Redis has no log of the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas import keys
from schemas.codec import decode_event, decode_job, encode
from schemas.params import SamplingParams
from schemas.wire import Cancel, ChatMessage, Event, Finished, Job, Restarted, Token


class InflightClient:
    """Args:
    bootstrap_servers: Kafka bootstrap servers.
    redis_url: Redis URL the workers publish to.
    topic_prefix, key_prefix: must match the workers' `kafka.topic_prefix` / `redis.key_prefix`.
    reconnect_s: how long Redis may stay unreachable before `stream` gives up (when no
        `timeout_s` bounds it), seconds.
    results_fallback_s: `result()` looks the job up in the durable results topic once the
        Redis log has shown nothing for this long, and every 10 s after (a Redis that
        restarted empty lost the log of a finished job; its outcome is still there).
    """

    def __init__(self, bootstrap_servers: str, redis_url: str, *, topic_prefix: str = "inflight",
                 key_prefix: str = "inflight", tombstone_ttl_s: int = 3600, reconnect_s: float = 60.0,
                 results_fallback_s: float = 5.0) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic_prefix = topic_prefix
        self.key_prefix = key_prefix
        self.tombstone_ttl_s = tombstone_ttl_s
        self.reconnect_s = reconnect_s
        self.results_fallback_s = results_fallback_s
        # Blocking pool: many concurrent streams wait for a connection instead of failing.
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=32, timeout=None, health_check_interval=15,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3), retry_on_error=list(_REDIS_DOWN))
        self.redis = aioredis.Redis(connection_pool=pool)
        self._subscriber = _SharedSubscriber(self.redis)
        self._producer: AIOKafkaProducer | None = None
        self._results_consumer: AIOKafkaConsumer | None = None
        self._results_lock = asyncio.Lock()
        self._lookups: list[tuple[set[str], asyncio.Future]] = []

    async def __aenter__(self) -> InflightClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _kafka(self) -> AIOKafkaProducer:
        if self._producer is None:
            self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap_servers, acks="all",
                                              max_request_size=16 * 1024 * 1024)
            await self._producer.start()
        return self._producer

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
        if self._results_consumer is not None:
            await self._results_consumer.stop()
            self._results_consumer = None
        await self._subscriber.close()
        await self.redis.aclose()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        priority: str = "normal",
        job_id: str | None = None,
        deadline: float | None = None,
        tenant: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> str:
        """Produce a job to `inflight.jobs.<priority>`; returns its job_id.

        Raises:
            ValueError: invalid priority or job fields.
        """
        if priority not in keys.PRIORITIES:
            raise ValueError(f"priority must be one of {list(keys.PRIORITIES)}, got {priority!r}")
        job = Job(
            job_id=job_id or uuid.uuid4().hex,
            prompt=prompt,
            messages=[ChatMessage(**m) for m in messages] if messages is not None else None,
            prompt_token_ids=prompt_token_ids,
            params=params or SamplingParams(),
            deadline=deadline,
            tenant=tenant,
            created_at=time.time(),
            metadata=metadata,
        )
        try:  # the checks a worker applies (id pattern and length, field constraints)
            decode_job(encode(job))
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid job: {e}") from None
        await self.submit_job(job, priority)
        return job.job_id

    async def submit_job(self, job: Job, priority: str = "normal") -> None:
        producer = await self._kafka()
        await producer.send_and_wait(keys.job_topic(self.topic_prefix, priority), encode(job), key=job.job_id.encode())

    async def cancel(self, job_id: str, reason: str | None = None) -> None:
        """Cancel a job wherever it is. Also sets the tombstone directly, so a job that
        no worker has consumed yet is dropped on arrival even if no worker is running."""
        await self.redis.set(keys.cancelled_key(job_id, self.key_prefix), b"1", ex=self.tombstone_ttl_s)
        producer = await self._kafka()
        await producer.send_and_wait(keys.cancel_topic(self.topic_prefix), encode(Cancel(job_id=job_id, reason=reason)),
                                     key=job_id.encode())

    async def read_log(self, job_id: str, after_seq: int = -1) -> list[Event]:
        """Events already in the job's log with seq > after_seq, in order."""
        entries = await self.redis.xrange(keys.log_key(job_id, self.key_prefix))
        out = []
        for _, fields in entries:
            ev = decode_event(fields[b"e"])
            if ev.seq > after_seq:
                out.append(ev)
        return out

    async def stream(self, job_id: str, *, timeout_s: float | None = None, poll_s: float = 1.0,
                     fallback: bool = False) -> AsyncIterator[Event]:
        """Yield the job's events in `seq` order, each once, ending with `finished`.

        Connection errors (a Redis restart, a failover) are retried with backoff until
        `timeout_s` (or for `reconnect_s` of continuous failure when there is no
        timeout); after a reconnect the channel is subscribed again and the log re-read
        from the last seq yielded. With `fallback`, a job whose log stays empty is also
        looked up in the durable results topic (its `finished` is yielded alone).

        Raises:
            TimeoutError: no terminal event within `timeout_s`.
            redis.exceptions.ConnectionError: Redis unreachable for longer than allowed.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        channel = keys.channel(job_id, self.key_prefix).encode()
        queue = await self._subscriber.add(channel)
        last = -1
        started = time.monotonic()
        next_lookup = started + self.results_fallback_s
        down_since: float | None = None
        delay = 0.05
        try:
            need_log = True  # replay after subscribing: no gap
            while True:
                try:
                    if need_log:
                        evs = await self.read_log(job_id, last)
                        need_log = False
                    down_since, delay = None, 0.05
                except _REDIS_DOWN:
                    now = time.monotonic()
                    down_since = down_since or now
                    if deadline is not None and now > deadline:
                        raise TimeoutError(
                            f"job {job_id} did not finish within {timeout_s} s (Redis unreachable)") from None
                    if deadline is None and now - down_since > self.reconnect_s:
                        raise
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                for ev in evs:
                    if ev.seq > last:
                        last = ev.seq
                        yield ev
                        if isinstance(ev, Finished):
                            return
                evs = []
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    raise TimeoutError(f"job {job_id} did not finish within {timeout_s} s")
                if fallback and last < 0 and now >= next_lookup:
                    next_lookup = now + 10.0
                    found = await self.lookup_results([job_id])
                    if job_id in found:
                        yield found[job_id]
                        return
                try:
                    data = await asyncio.wait_for(queue.get(), poll_s)
                except TimeoutError:  # quiet: check the log in case a live message was lost
                    data = _RESYNC
                if data is _RESYNC:
                    need_log = True
                else:
                    ev = decode_event(data)
                    if ev.seq > last + 1:  # a gap: fill it from the log
                        need_log = True
                    else:
                        evs = [ev]
        finally:
            await self._subscriber.remove(channel, queue)

    async def result(self, job_id: str, timeout_s: float | None = None) -> Finished:
        """Wait for the job's terminal event; falls back to the durable results topic when
        the Redis log stays empty (see `results_fallback_s`).

        Raises:
            TimeoutError: no terminal event within `timeout_s`.
        """
        async with contextlib.aclosing(self.stream(job_id, timeout_s=timeout_s, fallback=True)) as events:
            async for ev in events:
                if isinstance(ev, Finished):
                    return ev
        raise RuntimeError("unreachable: a stream ends with its finished event")

    async def lookup_results(self, job_ids: list[str], timeout_s: float = 30.0) -> dict[str, Finished]:
        """The recorded terminal events of `job_ids` from the durable results topic (jobs
        not finished yet are absent). Concurrent lookups share one scan."""
        from worker.results import read_results

        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._lookups.append((set(job_ids), fut))
        async with self._results_lock:
            if not fut.done():
                batch, self._lookups = self._lookups, []
                if self._results_consumer is None:
                    self._results_consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap_servers,
                                                              group_id=None, enable_auto_commit=False)
                    await self._results_consumer.start()
                wanted = sorted(set().union(*(ids for ids, _ in batch)))
                producer = await self._kafka()
                found = await read_results(self._results_consumer, producer.partitions_for, self.topic_prefix, wanted,
                                           timeout_s)
                for ids, f in batch:
                    f.set_result({j: found[j] for j in ids if j in found})
        return await fut


_RESYNC = object()
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


class _SharedSubscriber:
    """One pub/sub connection for all of a client's streams (a PubSub per stream would
    hold a pooled connection each and exhaust the pool). Messages are dispatched to
    per-stream queues; after a connection error it reconnects with backoff, resubscribes
    every channel and tells each stream to re-read its log (before and after the
    resubscription, so nothing published in between is missed)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.queues: dict[bytes, set[asyncio.Queue]] = {}
        self._pubsub = None
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    async def add(self, channel: bytes) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        async with self._lock:
            if self._pubsub is None:
                self._pubsub = self.redis.pubsub()
            subs = self.queues.setdefault(channel, set())
            subs.add(q)
            if len(subs) == 1:
                try:
                    await self._pubsub.subscribe(channel)
                except _REDIS_DOWN:
                    q.put_nowait(_RESYNC)  # the reader reconnects and subscribes every channel
            if self._task is None or self._task.done():
                self._task = asyncio.create_task(self._read())
        return q

    async def remove(self, channel: bytes, q: asyncio.Queue) -> None:
        async with self._lock:
            subs = self.queues.get(channel)
            if subs is None:
                return
            subs.discard(q)
            if not subs:
                del self.queues[channel]
                if self._pubsub is not None and not self._closed:
                    with contextlib.suppress(*_REDIS_DOWN, AttributeError):
                        await self._pubsub.unsubscribe(channel)

    def _resync_all(self) -> None:
        for subs in self.queues.values():
            for q in subs:
                q.put_nowait(_RESYNC)

    async def _read(self) -> None:
        delay = 0.05
        while not self._closed:
            try:
                if not self._pubsub.subscribed:
                    await asyncio.sleep(0.05)
                    continue
                msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                delay = 0.05
            except _REDIS_DOWN:
                self._resync_all()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                async with self._lock:
                    with contextlib.suppress(Exception):
                        await self._pubsub.aclose()
                    self._pubsub = self.redis.pubsub()
                    try:
                        if self.queues:
                            await self._pubsub.subscribe(*self.queues)
                        self._resync_all()
                    except _REDIS_DOWN:
                        pass  # still down: the next read fails and we come back here
                continue
            if msg is not None:
                for q in self.queues.get(msg["channel"], ()):
                    q.put_nowait(msg["data"])

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()


def last_attempt_tokens(events: list[Event]) -> list[Token]:
    """The `token` events of the last attempt (a `restarted` drops those before it)."""
    tokens: list[Token] = []
    for ev in events:
        if isinstance(ev, Restarted):
            tokens = []
        elif isinstance(ev, Token):
            tokens.append(ev)
    return tokens


def text_of(events: list[Event]) -> str:
    """Concatenate the token text of the last attempt."""
    return "".join(t.text for t in last_attempt_tokens(events))


__all__ = ["InflightClient", "last_attempt_tokens", "text_of"]
