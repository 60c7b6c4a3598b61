"""Create the Kafka topics Inflight uses (idempotent)."""

from __future__ import annotations

import contextlib

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from schemas import keys

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


async def create_topics(bootstrap_servers: str, prefix: str = "inflight", partitions: int = 6,
                        replication_factor: int = 1) -> list[str]:
    """Create `<prefix>.jobs.{high,normal,low}`, `<prefix>.cancel`, `<prefix>.dlq`.
    Returns the names that were created (existing ones are left as they are)."""
    names = [keys.job_topic(prefix, p) for p in keys.PRIORITIES] + [keys.cancel_topic(prefix), keys.dlq_topic(prefix)]
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        new = [
            NewTopic(n, num_partitions=partitions, replication_factor=replication_factor,
                     topic_configs={"max.message.bytes": str(MAX_MESSAGE_BYTES)})
            for n in names if n not in existing
        ]
        if new:
            with contextlib.suppress(TopicAlreadyExistsError):  # another process won the race
                await admin.create_topics(new)
        return [t.name for t in new]
    finally:
        await admin.close()
