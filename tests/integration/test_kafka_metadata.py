"""`worker.security.kafka`'s cluster requests against the dev stack's broker, through
each kind of aiokafka client the project makes."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from schemas import keys
from worker.security.kafka import existing_topics, partition_ids, ping_cluster


def test_ping_and_lookups_through_producer_consumer_and_admin(services, prefix):
    async def go():
        bootstrap = services[0]
        clients = [AIOKafkaProducer(bootstrap_servers=bootstrap), AIOKafkaConsumer(bootstrap_servers=bootstrap),
                   AIOKafkaAdminClient(bootstrap_servers=bootstrap)]
        for c in clients:
            await c.start()
        try:
            jobs = keys.job_topics(prefix)
            missing = f"{prefix}.no-such-topic"
            for c in clients:
                await ping_cluster(c)
                assert await existing_topics(c, [*jobs, missing]) == set(jobs)
                assert await partition_ids(c, jobs[0]) == {0, 1, 2}  # the prefix fixture makes 3
                assert await partition_ids(c, missing) == set()
            assert missing not in await clients[2].list_topics()  # looked up, not created
        finally:
            await clients[0].stop()
            await clients[1].stop()
            await clients[2].close()

    asyncio.run(go())
