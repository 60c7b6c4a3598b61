"""Cancel listener: reads every partition of `inflight.cancel` without a consumer group,
so whichever worker holds the job sees the cancel.

Each valid cancel is handed to `on_cancel(job_id)` (the worker sets the tombstone, so a
job not consumed yet is dropped on arrival, and aborts the job if it runs here: KV freed
at the next step boundary, then `finished(cancelled)`). Cancels for finished or unknown
jobs change nothing visible. On start, and again after Redis lost its data, the listener
rewinds `kafka.cancel_lookback_s` so cancels sent meanwhile are honoured.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from schemas import keys
from schemas.codec import decode_cancel
from worker.config import KafkaConfig
from worker.security.access import is_fatal_kafka
from worker.security.kafka import kafka_security_kwargs

log = structlog.get_logger(__name__)


class CancelListener:
    """Args:
    cfg: the `kafka` config section.
    client_id: Kafka client id.
    on_cancel: awaited with the job id of every valid cancel.
    partitions_for: returns the partition ids of a topic, fetching its metadata
        (`AIOKafkaProducer.partitions_for`).
    """

    def __init__(self, cfg: KafkaConfig, client_id: str, on_cancel: Callable[[str], Awaitable[None]],
                 partitions_for: Callable[[str], Awaitable[set[int]]]) -> None:
        self._partitions_for = partitions_for
        self.cfg = cfg
        self.topic = keys.cancel_topic(cfg.topic_prefix)
        self._on_cancel = on_cancel
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=cfg.bootstrap_servers,
            group_id=None,
            client_id=f"{client_id}-cancels",
            enable_auto_commit=False,
            **kafka_security_kwargs(cfg),
        )
        self.num_cancels = 0
        self._rewind = False

    async def start(self) -> None:
        """Raises:
        RuntimeError: the cancel topic does not exist (`inflight topics create`).
        aiokafka.errors.TopicAuthorizationFailedError: the principal may not describe it."""
        await self.consumer.start()
        try:
            parts = await asyncio.wait_for(self._partitions_for(self.topic), 15)
        except (TimeoutError, KafkaError) as e:
            if is_fatal_kafka(e):  # not visible to this principal: say so, not "does not exist"
                raise
            parts = None
        if not parts:
            raise RuntimeError(f"cancel topic {self.topic!r} does not exist; run `inflight topics create`")
        self.consumer.assign([TopicPartition(self.topic, p) for p in sorted(parts)])
        await self._seek_lookback()

    async def _seek_lookback(self) -> None:
        tps = list(self.consumer.assignment())
        since_ms = int((time.time() - self.cfg.cancel_lookback_s) * 1000)
        found = await self.consumer.offsets_for_times({tp: since_ms for tp in tps})
        ends = await self.consumer.end_offsets(tps)
        for tp in tps:
            at = found.get(tp)
            self.consumer.seek(tp, at.offset if at is not None else ends[tp])

    def rewind(self) -> None:
        """Re-read the last `cancel_lookback_s` of cancels (their tombstones were lost)."""
        self._rewind = True

    async def stop(self) -> None:
        await self.consumer.stop()

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            if self._rewind:
                self._rewind = False
                await self._seek_lookback()
            batch = await self.consumer.getmany(timeout_ms=200)
            for recs in batch.values():
                for rec in recs:
                    await self.handle(rec.value or b"")

    async def handle(self, data: bytes) -> None:
        try:
            cancel = decode_cancel(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("invalid cancel message ignored", error=str(e)[:300])
            return
        self.num_cancels += 1
        await self._on_cancel(cancel.job_id)
