"""Create the Kafka topics Inflight uses (idempotent)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from schemas import keys
from worker.security.kafka import existing_topics, kafka_security_kwargs

if TYPE_CHECKING:
    from schemas.pools import Pools
    from worker.config import KafkaConfig

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


async def create_topics(bootstrap_servers: str | None, prefix: str = "inflight", partitions: int = 6,
                        replication_factor: int = 1, *, kafka: KafkaConfig | None = None,
                        pools: Pools | None = None) -> list[str]:
    """Create `<prefix>.jobs.{high,normal,low}` (and `<prefix>.jobs.<pool>.{...}` of every
    other pool), `<prefix>.cancel`, `<prefix>.dlq` and the compacted `<prefix>.results`.
    Returns the names that were created (existing ones are left as they are).

    Args:
        bootstrap_servers: the cluster; None takes `kafka.bootstrap_servers`.
        kafka: connection security (SASL, TLS) of a principal allowed to create topics
            (Create on the cluster or the topics); None connects in PLAINTEXT.
        pools: the deployment's pools (schemas/pools.py); None: the default pool only.

    Raises:
        RuntimeError: the broker refused a topic (e.g. replication factor above the
            number of brokers, or no Create permission); the message names each topic and
            the broker's reason.
        ConfigError: a secret or certificate file of `kafka` cannot be read.
    """
    names = keys.all_topics(prefix, pools)
    results = keys.results_topic(prefix)
    security = kafka_security_kwargs(kafka) if kafka is not None else {}
    bootstrap = bootstrap_servers or (kafka.bootstrap_servers if kafka is not None else "127.0.0.1:19092")
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **security)
    await admin.start()
    try:
        existing = await existing_topics(admin, names)  # not list_topics: it grows with the cluster
        new = [
            NewTopic(n, num_partitions=partitions, replication_factor=replication_factor,
                     topic_configs={"max.message.bytes": str(MAX_MESSAGE_BYTES),
                                    **({"cleanup.policy": "compact"} if n == results else {})})
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
