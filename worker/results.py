"""The durable record of outcomes: every terminal event is also written to the compacted
topic `<prefix>.results`, keyed by job_id, before the job's offset may be committed.
Redis is the live channel (pub/sub + a replay log with a TTL); if it restarts empty,
outcomes are still readable here, by `InflightClient.result()` (fallback) and by anything
that needs guaranteed outcomes (a batch collector). Compaction keeps the latest record
per job id, so a job finished twice (a redelivery racing its first run) still reads as
one outcome.

Writer: `ResultsLog.record` (the worker). Reader: `read_results` (clients), which scans
the partitions the keys hash to — a fallback path, not the hot one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner

from schemas import keys
from schemas.codec import decode_event
from schemas.wire import Finished
from worker.access import raise_if_refused


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
            worker.access.Refused: the principal may not write the results topic.
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


async def read_results(consumer: AIOKafkaConsumer, partitions_for: Callable[[str], Awaitable[set[int]]],
                       topic_prefix: str, job_ids: list[str], timeout_s: float = 30.0) -> dict[str, Finished]:
    """The latest recorded terminal event of each job in `job_ids` that has one.

    Args:
        consumer: a started consumer without a group (`group_id=None`) on the cluster.
        partitions_for: the partition ids of a topic, fetching its metadata
            (`AIOKafkaProducer.partitions_for`).
        topic_prefix: the workers' `kafka.topic_prefix`.
        job_ids: jobs to look up.
        timeout_s: give up reading after this long (returns what was found).

    Reads each partition the ids hash to (Kafka's default murmur2 partitioner, the one
    the worker's producer uses) from its beginning to its end offset at call time.
    """
    topic = keys.results_topic(topic_prefix)
    parts = await partitions_for(topic)
    if not parts:
        return {}
    all_parts = sorted(parts)
    wanted = set(job_ids)
    partitioner = DefaultPartitioner()
    tps = sorted({TopicPartition(topic, partitioner(jid.encode(), all_parts, all_parts)) for jid in wanted},
                 key=lambda tp: tp.partition)
    consumer.assign(tps)
    ends = await consumer.end_offsets(tps)
    starts = await consumer.beginning_offsets(tps)
    for tp in tps:
        consumer.seek(tp, starts[tp])
    found: dict[str, Finished] = {}
    remaining = {tp for tp in tps if ends[tp] > starts[tp]}
    deadline = time.monotonic() + timeout_s
    while remaining and time.monotonic() < deadline:
        batch = await consumer.getmany(*remaining, timeout_ms=200)
        for recs in batch.values():
            for rec in recs:
                jid = rec.key.decode() if rec.key else None
                if jid in wanted and rec.value:
                    ev = decode_event(rec.value)
                    if isinstance(ev, Finished):
                        found[jid] = ev
        for tp in list(remaining):
            if await consumer.position(tp) >= ends[tp]:
                remaining.discard(tp)
    return found
