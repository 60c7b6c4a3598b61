"""The durable record of outcomes: every terminal event is also written to the compacted
topic `<prefix>.results`, keyed by job_id, before the job's offset may be committed.
Redis is the live channel (pub/sub + a replay log with a TTL); if it restarts empty,
outcomes are still readable here, by `InflightClient.result()` (fallback) and by anything
that needs guaranteed outcomes (a batch collector). Compaction keeps the latest record
per job id, so a job finished twice (a redelivery racing its first run) still reads as
one outcome.

Writer: `ResultsLog.record` (the worker's finalizer). Reader:
`worker.client.results.read_results` (clients), which scans the partitions the keys hash
to — a fallback path, not the hot one.
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner

from schemas import keys
from worker.security.access import raise_if_refused


class ResultsLog:
    """Writes terminal events through the worker's producer."""

    def __init__(self, producer: AIOKafkaProducer, topic_prefix: str) -> None:
        self.producer = producer
        self.topic = keys.results_topic(topic_prefix)
        self._partitions: list[int] = []
        self._partitioner = DefaultPartitioner()

    async def record(self, items: list[tuple[str, bytes]]) -> None:
        """Produce (job_id, encoded `finished` event) pairs and wait for every ack. Records
        are grouped into one batch per partition (the key's partition under Kafka's
        default partitioner, as a keyed `send` would choose): far cheaper than one `send`
        per record when many jobs end together.

        Raises:
            aiokafka.errors.KafkaError: the broker did not take one (the caller retries;
                the offsets stay uncommitted meanwhile).
            worker.security.access.Refused: the principal may not write the results topic.
        """
        if not items:
            return
        try:
            await self._send(items)
        except KafkaError as e:
            raise_if_refused(e)
            raise

    async def _send(self, items: list[tuple[str, bytes]]) -> None:
        if not self._partitions:
            self._partitions = sorted(await self.producer.partitions_for(self.topic))
        parts = self._partitions
        by_partition: dict[int, list[tuple[bytes, bytes]]] = {}
        for job_id, data in items:
            key = job_id.encode()
            by_partition.setdefault(self._partitioner(key, parts, parts), []).append((key, data))
        futs = []
        for partition, records in by_partition.items():
            batch = self.producer.create_batch()
            for key, value in records:
                if batch.append(key=key, value=value, timestamp=None) is None:  # full: send it, start another
                    futs.append(await self.producer.send_batch(batch, self.topic, partition=partition))
                    batch = self.producer.create_batch()
                    batch.append(key=key, value=value, timestamp=None)
            futs.append(await self.producer.send_batch(batch, self.topic, partition=partition))
        await asyncio.gather(*futs)
