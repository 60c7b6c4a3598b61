"""Create the Kafka topics Inflight uses (idempotent)."""

from __future__ import annotations

import contextlib

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from schemas import keys

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


async def create_topics(bootstrap_servers: str, prefix: str = "inflight", partitions: int = 6,
                        replication_factor: int = 1) -> list[str]:
    """Create `<prefix>.jobs.{high,normal,low}`, `<prefix>.cancel`, `<prefix>.dlq`.
    Returns the names that were created (existing ones are left as they are).

    Raises:
        RuntimeError: the broker refused a topic (e.g. replication factor above the
            number of brokers); the message names each topic and the broker's reason.
    """
    names = keys.all_topics(prefix)
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
                resp = await admin.create_topics(new)
                refused = []
                for err in resp.topic_errors:  # (topic, error_code[, error_message])
                    topic, code = err[0], err[1]
                    if code and for_code(code) is not TopicAlreadyExistsError:
                        msg = err[2] if len(err) > 2 and err[2] else for_code(code).__name__
                        refused.append(f"{topic}: {msg}")
                if refused:
                    raise RuntimeError("the broker refused to create: " + "; ".join(refused))
        return [t.name for t in new]
    finally:
        await admin.close()
