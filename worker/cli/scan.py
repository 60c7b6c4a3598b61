"""Reading whole topics as an operator tool does: every record of some topics from a point
in time up to their end offsets at the call (`inflight dlq list`, `inflight jobs audit`,
`inflight job show`)."""

from __future__ import annotations

from typing import Any


async def scan_topics(kafka, topics: list[str], since_ms: int | None = None) -> list[Any]:
    """Every record of `topics` (aiokafka `ConsumerRecord`s, with `.topic`) written at or
    after `since_ms` (Unix ms; None: from the beginning), up to the end offsets at the call;
    in partition order, oldest first in each. Topics that do not exist are skipped.

    Args:
        kafka: the `KafkaConfig` (bootstrap servers, security, fetch size).

    Raises:
        aiokafka.errors.KafkaError: Kafka unreachable, or the principal may not read a topic.
        ValueError: none of `topics` exists (or is visible to this principal).
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    from worker.security.kafka import kafka_security_kwargs, stop_client, topic_metadata

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers, client_id="inflight-scan",
                                **kafka_security_kwargs(kafka))
    await admin.start()
    try:
        described = await topic_metadata(admin, topics)  # never auto-creates a topic it names
    finally:
        await admin.close()
    tps = [TopicPartition(t["topic"], p["partition"]) for t in described if t["error_code"] == 0
           for p in sorted(t["partitions"], key=lambda p: p["partition"])]
    if not tps:
        raise ValueError(f"none of the topics {topics} exists (or is visible to this principal)")
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, group_id=None, enable_auto_commit=False,
                                max_partition_fetch_bytes=kafka.max_partition_fetch_bytes,
                                **kafka_security_kwargs(kafka))
    await consumer.start()
    out: dict[Any, list] = {tp: [] for tp in tps}
    try:
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        starts = await consumer.beginning_offsets(tps)
        if since_ms is not None:
            found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
            starts = {tp: (found[tp].offset if found.get(tp) is not None else ends[tp]) for tp in tps}
        for tp in tps:
            consumer.seek(tp, starts[tp])
        pending = {tp for tp in tps if starts[tp] < ends[tp]}
        while pending:
            batch = await consumer.getmany(*pending, timeout_ms=1000)
            for tp, records in batch.items():
                out[tp] += [r for r in records if r.offset < ends[tp]
                            and (since_ms is None or r.timestamp >= since_ms)]
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
    finally:
        await stop_client(consumer, "scan")
    return [r for tp in tps for r in out[tp]]
