"""Producer / consumer helpers: submit jobs, stream their events, cancel them.

Imports neither torch nor engine code (`pip install "inflight-worker[client]"`).

`stream()` subscribes to the job's channel first, then replays the job's log, so no
event is missed between the two; it dedupes by `seq`, survives late subscription
(the log keeps the whole sequence for its TTL), re-reads the log after a dropped
connection, and passes `restarted` through (the caller drops earlier partial text).
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
from aiokafka import AIOKafkaProducer
from redis.exceptions import ConnectionError as RedisConnectionError

from schemas import keys
from schemas.codec import decode_event, decode_job, encode
from schemas.params import SamplingParams
from schemas.wire import Cancel, ChatMessage, Event, Finished, Job, Restarted, Token


class InflightClient:
    """Args:
    bootstrap_servers: Kafka bootstrap servers.
    redis_url: Redis URL the workers publish to.
    topic_prefix, key_prefix: must match the workers' `kafka.topic_prefix` / `redis.key_prefix`.
    """

    def __init__(self, bootstrap_servers: str, redis_url: str, *, topic_prefix: str = "inflight",
                 key_prefix: str = "inflight", tombstone_ttl_s: int = 3600) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic_prefix = topic_prefix
        self.key_prefix = key_prefix
        self.tombstone_ttl_s = tombstone_ttl_s
        # Blocking pool: many concurrent streams wait for a connection instead of failing.
        pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=32, timeout=None,
                                                        health_check_interval=15)
        self.redis = aioredis.Redis(connection_pool=pool)
        self._subscriber = _SharedSubscriber(self.redis)
        self._producer: AIOKafkaProducer | None = None

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

    async def stream(self, job_id: str, *, timeout_s: float | None = None, poll_s: float = 1.0) -> AsyncIterator[Event]:
        """Yield the job's events in `seq` order, each once, ending with `finished`.

        Raises:
            TimeoutError: no terminal event within `timeout_s`.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        channel = keys.channel(job_id, self.key_prefix).encode()
        queue = await self._subscriber.add(channel)
        last = -1
        try:
            evs = await self.read_log(job_id, last)  # replay after subscribing: no gap
            while True:
                for ev in evs:
                    if ev.seq > last:
                        last = ev.seq
                        yield ev
                        if isinstance(ev, Finished):
                            return
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} did not finish within {timeout_s} s")
                try:
                    data = await asyncio.wait_for(queue.get(), poll_s)
                except TimeoutError:  # quiet: check the log in case a live message was lost
                    data = _RESYNC
                if data is _RESYNC:
                    evs = await self.read_log(job_id, last)
                else:
                    evs = [decode_event(data)]
                    if evs[0].seq > last + 1:  # a gap: fill it from the log
                        evs = await self.read_log(job_id, last)
        finally:
            await self._subscriber.remove(channel, queue)

    async def result(self, job_id: str, timeout_s: float | None = None) -> Finished:
        """Wait for the job's terminal event."""
        async for ev in self.stream(job_id, timeout_s=timeout_s):
            if isinstance(ev, Finished):
                return ev
        raise RuntimeError("unreachable")


_RESYNC = object()


class _SharedSubscriber:
    """One pub/sub connection for all of a client's streams (a PubSub per stream would
    hold a pooled connection each and exhaust the pool). Messages are dispatched to
    per-stream queues; after a connection error it reconnects, resubscribes every
    channel and tells each stream to re-read its log."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.queues: dict[bytes, set[asyncio.Queue]] = {}
        self._pubsub = None
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def add(self, channel: bytes) -> asyncio.Queue:
        async with self._lock:
            if self._pubsub is None:
                self._pubsub = self.redis.pubsub()
            q: asyncio.Queue = asyncio.Queue()
            subs = self.queues.setdefault(channel, set())
            subs.add(q)
            if len(subs) == 1:
                await self._pubsub.subscribe(channel)
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
                with contextlib.suppress(RedisConnectionError, OSError):
                    await self._pubsub.unsubscribe(channel)

    async def _read(self) -> None:
        while True:
            try:
                if not self._pubsub.subscribed:
                    await asyncio.sleep(0.05)
                    continue
                msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            except (RedisConnectionError, OSError):
                for subs in self.queues.values():
                    for q in subs:
                        q.put_nowait(_RESYNC)
                await asyncio.sleep(0.2)
                async with self._lock:
                    with contextlib.suppress(Exception):
                        await self._pubsub.aclose()
                    self._pubsub = self.redis.pubsub()
                    with contextlib.suppress(RedisConnectionError, OSError):
                        if self.queues:
                            await self._pubsub.subscribe(*self.queues)
                continue
            if msg is not None:
                for q in self.queues.get(msg["channel"], ()):
                    q.put_nowait(msg["data"])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pubsub is not None:
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
