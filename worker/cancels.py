"""Cancel listener: reads every partition of `inflight.cancel` without a consumer group,
so whichever worker holds the job sees the cancel.

For each cancel: a tombstone is set in Redis (TTL), so a job that has not been consumed
yet is dropped on arrival; a job running here is aborted in the engine (KV freed at the
next step boundary, then `finished(cancelled)`). Cancels for finished or unknown jobs
change nothing visible. On start the listener rewinds `cancel_lookback_s` so cancels sent
while no worker was up are still honoured.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from schemas import keys
from schemas.codec import decode_cancel
from worker.intake import kafka_security_kwargs

if TYPE_CHECKING:
    from worker.app import Worker

log = structlog.get_logger(__name__)


class CancelListener:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        cfg = worker.cfg.kafka
        self.topic = keys.cancel_topic(cfg.topic_prefix)
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=cfg.bootstrap_servers,
            group_id=None,
            client_id=f"{worker.worker_id}-cancels",
            enable_auto_commit=False,
            **kafka_security_kwargs(cfg),
        )
        self.num_cancels = 0

    async def start(self) -> None:
        await self.consumer.start()
        try:  # the intake's producer fetches topic metadata through the public API
            parts = await asyncio.wait_for(self.worker.intake.producer.partitions_for(self.topic), 15)
        except (TimeoutError, KafkaError):
            parts = None
        if not parts:
            raise RuntimeError(f"cancel topic {self.topic!r} does not exist; run `inflight topics create`")
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        since_ms = int((time.time() - self.worker.cfg.kafka.cancel_lookback_s) * 1000)
        found = await self.consumer.offsets_for_times({tp: since_ms for tp in tps})
        ends = await self.consumer.end_offsets(tps)
        for tp in tps:
            at = found.get(tp)
            self.consumer.seek(tp, at.offset if at is not None else ends[tp])

    async def stop(self) -> None:
        await self.consumer.stop()

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
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
        self.worker.metrics.cancels.inc()
        await self.worker.cancel(cancel.job_id)
