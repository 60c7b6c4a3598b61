"""Reading the durable record of outcomes: the latest terminal event of each job from the
compacted topic `<prefix>.results` that the worker's finalizer writes
(`worker.serve.results.ResultsLog`). The fallback of `InflightClient.result()` when
Redis lost a job's log, and what anything needing guaranteed outcomes reads.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from schemas import keys
from schemas.codec import decode_event
from schemas.wire import Finished


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
