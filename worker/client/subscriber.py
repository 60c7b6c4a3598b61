"""One pub/sub connection shared by all of an `InflightClient`'s streams (a PubSub per
stream would hold a pooled connection each and exhaust the pool), with reconnects."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from worker.obs.errors import suppressed
from worker.obs.stopping import honour_cancellation
from worker.security.redis import REDIS_DOWN

log = logging.getLogger(__name__)

RESYNC = object()  # put on a stream's queue: re-read the job's log (a message may have been lost)


class Denied:
    """Put in a stream's queue when the server refused its SUBSCRIBE (NOPERM)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class SharedSubscriber:
    """One pub/sub connection for all of a client's streams (a PubSub per stream would
    hold a pooled connection each and exhaust the pool). Messages are dispatched to
    per-stream queues; after a connection error it reconnects with backoff, resubscribes
    every channel and tells each stream to re-read its log (before and after the
    resubscription, so nothing published in between is missed).

    A SUBSCRIBE the server refuses (an ACL user confined to other channels) answers with
    an error instead of its confirmation; replies come in order, so the refused channel
    is the oldest one still waiting for its confirmation (`_pending`): its streams get
    `Denied` and the channel is dropped, the others are unaffected."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.queues: dict[bytes, set[asyncio.Queue]] = {}
        self._pending: collections.deque[bytes] = collections.deque()
        self._pubsub = None
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self._has_channels = asyncio.Event()  # wakes an idle reader at once (no polling delay)

    async def add(self, channel: bytes) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        async with self._lock:
            if self._pubsub is None:
                self._pubsub = self.redis.pubsub()
            subs = self.queues.setdefault(channel, set())
            subs.add(q)
            if len(subs) == 1:
                try:
                    self._pending.append(channel)
                    await self._pubsub.subscribe(channel)
                except REDIS_DOWN:
                    q.put_nowait(RESYNC)  # the reader reconnects and subscribes every channel
            if self._task is None or self._task.done():
                self._task = asyncio.create_task(self._read())
            self._has_channels.set()
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
                    with contextlib.suppress(*REDIS_DOWN, AttributeError):
                        await self._pubsub.unsubscribe(channel)

    def _resync_all(self) -> None:
        for subs in self.queues.values():
            for q in subs:
                q.put_nowait(RESYNC)

    async def _read(self) -> None:
        delay = 0.05
        while not self._closed:
            honour_cancellation()  # a read whose client swallowed the close's cancel ends here
            try:
                if not self._pubsub.subscribed:
                    self._has_channels.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await self._has_channels.wait()
                    continue
                msg = await self._pubsub.get_message(timeout=1.0)
                delay = 0.05
            except NoPermissionError as e:
                self._deny(e)
                continue
            except REDIS_DOWN:
                self._resync_all()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                async with self._lock:
                    with suppressed(log, "closing the broken pub/sub connection"):
                        await self._pubsub.aclose()
                    self._pubsub = self.redis.pubsub()
                    try:
                        self._pending.clear()
                        if self.queues:
                            self._pending.extend(self.queues)
                            await self._pubsub.subscribe(*self.queues)
                        self._resync_all()
                    except REDIS_DOWN:
                        pass  # still down: the next read fails and we come back here
                continue
            if msg is None:
                continue
            if msg["type"] == "subscribe":
                with contextlib.suppress(ValueError):
                    self._pending.remove(msg["channel"])
            elif msg["type"] == "message":
                for q in self.queues.get(msg["channel"], ()):
                    q.put_nowait(msg["data"])

    def _deny(self, error: Exception) -> None:
        if not self._pending:
            return
        channel = self._pending.popleft()
        for q in self.queues.pop(channel, ()):
            q.put_nowait(Denied(error))
        if self._pubsub is not None:
            self._pubsub.channels.pop(channel, None)  # never resubscribed after a reconnect

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})  # not `await task` under suppress: that swallows our own cancel
        if self._pubsub is not None:
            with suppressed(log, "closing the pub/sub connection"):
                await self._pubsub.aclose()
