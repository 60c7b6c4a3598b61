"""Cancel listener: reads every partition of `inflight.cancel` without a consumer group,
so whichever worker holds the job sees the cancel, and keeps the ids of every cancelled
job in memory: the cancel topic is the durable record of cancels, Redis' tombstones
only a cache (a Redis that restarts empty loses them; this index does not).

Each valid cancel is handed to `on_cancel(job_id, headers)` (the worker sets the tombstone, so a
job not consumed yet is dropped on arrival, and aborts the job if it runs here: KV freed
at the next step boundary, then `finished(cancelled)`) and added to the index, which the
claim step checks with the tombstone (`is_cancelled`). Cancels for finished or unknown
jobs change nothing visible.

On start the listener reads the cancel topic from its log start (the cancel topic's
retention, by default the job topics': every cancel of a job that may still run), or
from `kafka.cancel_lookback_s` ago when that is set, and the worker takes no job until
it has caught up with the end offsets it found (`caught_up`), so a job whose cancel was
acknowledged before the worker started is never run, whatever Redis lost. The index
holds at most `kafka.max_cancelled_ids` ids (the oldest go first, counted and logged);
measured replay speed and memory: docs/benchmarks.md.

Kafka errors are transient here (`kafka_outage.py`): retried with backoff, reported,
never a reason to stop; a refusal (authorization) propagates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError

from schemas import keys
from schemas.codec import decode_cancel
from worker.config import KafkaConfig
from worker.security.access import is_fatal_kafka
from worker.security.kafka import kafka_security_kwargs, stop_client

if TYPE_CHECKING:
    from worker.serve.kafka_outage import KafkaOutage

log = structlog.get_logger(__name__)


class CancelListener:
    """Reads every partition of the cancel topic (no group) and hands each cancel to the worker.

    Args:
        cfg: the `kafka` config section.
        client_id: Kafka client id.
        on_cancel: awaited with the job id of every valid cancel and its record's Kafka
            headers (the trace context of whoever cancelled).
        partitions_for: returns the partition ids of a topic, fetching its metadata
            (`AIOKafkaProducer.partitions_for`).
        outage: where transient Kafka errors are reported (None: only logged).
    """

    def __init__(self, cfg: KafkaConfig, client_id: str, on_cancel: Callable[[str, tuple], Awaitable[None]],
                 partitions_for: Callable[[str], Awaitable[set[int]]], outage: KafkaOutage | None = None) -> None:
        self._partitions_for = partitions_for
        self.cfg = cfg
        self.topic = keys.cancel_topic(cfg.topic_prefix)
        self._on_cancel = on_cancel
        self.outage = outage
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=cfg.bootstrap_servers,
            group_id=None,
            client_id=f"{client_id}-cancels",
            enable_auto_commit=False,
            **kafka_security_kwargs(cfg),
        )
        self.num_cancels = 0
        self.num_evicted = 0
        self._index: dict[str, None] = {}  # cancelled job ids, oldest first
        self._targets: dict[TopicPartition, int] = {}  # end offsets to reach before `caught_up`
        self._next: dict[TopicPartition, int] = {}  # next offset to read, per partition
        self.caught_up = asyncio.Event()
        self.replay_s: float | None = None  # time from start to caught up
        self._t0 = 0.0

    async def start(self) -> None:
        """Raises:
        RuntimeError: the cancel topic does not exist (`inflight topics create`).
        aiokafka.errors.TopicAuthorizationFailedError: the principal may not describe it."""
        self._t0 = time.monotonic()
        await self.consumer.start()
        try:
            async with asyncio.timeout(15):
                parts = await self._partitions_for(self.topic)
        except (TimeoutError, KafkaError) as e:
            if is_fatal_kafka(e):  # not visible to this principal: say so, not "does not exist"
                raise
            parts = None
        if not parts:
            raise RuntimeError(f"cancel topic {self.topic!r} does not exist; run `inflight topics create`")
        self.consumer.assign([TopicPartition(self.topic, p) for p in sorted(parts)])
        await self._seek_start()

    async def _seek_start(self) -> None:
        """Position every partition at the log start (or `cancel_lookback_s` ago) and note
        the end offsets to catch up with."""
        tps = list(self.consumer.assignment())
        ends = await self.consumer.end_offsets(tps)
        if self.cfg.cancel_lookback_s is None:
            starts = await self.consumer.beginning_offsets(tps)
        else:
            since_ms = int((time.time() - self.cfg.cancel_lookback_s) * 1000)
            found = await self.consumer.offsets_for_times({tp: since_ms for tp in tps})
            starts = {tp: found[tp].offset if found.get(tp) is not None else ends[tp] for tp in tps}
        for tp in tps:
            self.consumer.seek(tp, starts[tp])
            self._next[tp] = starts[tp]
        self._targets = dict(ends)
        self._check_caught_up()

    def _check_caught_up(self) -> None:
        if not self.caught_up.is_set() and all(self._next.get(tp, 0) >= end for tp, end in self._targets.items()):
            self.replay_s = time.monotonic() - self._t0
            self.caught_up.set()
            log.info("cancel topic read up to its end: jobs may be taken", cancelled_ids=len(self._index),
                     replay_s=round(self.replay_s, 3))

    def is_cancelled(self, job_id: str) -> bool:
        """A cancel for `job_id` was read (since the start point, within the index bound)."""
        return job_id in self._index

    def _remember(self, job_id: str) -> None:
        index = self._index
        if job_id in index:
            return
        index[job_id] = None
        if len(index) > self.cfg.max_cancelled_ids:
            del index[next(iter(index))]
            self.num_evicted += 1
            if self.num_evicted == 1 or self.num_evicted % 100_000 == 0:
                log.warning("cancel index full: the oldest cancelled ids are forgotten (their tombstones in Redis "
                            "still answer)", max_cancelled_ids=self.cfg.max_cancelled_ids, evicted=self.num_evicted)

    async def stop(self) -> None:
        await stop_client(self.consumer, "cancels")

    async def run(self, stopping: asyncio.Event) -> None:
        delay = 0.2
        while not stopping.is_set():
            try:
                await self._poll()
            except (KafkaError, IllegalStateError) as e:
                if is_fatal_kafka(e):
                    raise
                if self.outage is not None:
                    self.outage.failed("cancels", e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.2
            if self.outage is not None:
                self.outage.ok("cancels")

    async def _poll(self) -> None:
        batch = await self.consumer.getmany(timeout_ms=200)
        for tp, recs in batch.items():
            for rec in recs:
                await self.handle(rec.value or b"", rec.headers)
            if recs:
                self._next[tp] = recs[-1].offset + 1
        if not self.caught_up.is_set():
            if not batch:  # nothing more buffered: the positions say where we are
                for tp in self._targets:
                    self._next[tp] = max(self._next.get(tp, 0), await self.consumer.position(tp))
            self._check_caught_up()

    async def handle(self, data: bytes, headers: tuple = ()) -> None:
        try:
            cancel = decode_cancel(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("invalid cancel message ignored", error=str(e)[:300])
            return
        self.num_cancels += 1
        self._remember(cancel.job_id)
        await self._on_cancel(cancel.job_id, headers)
