"""Prefix affinity on the real broker: the client puts jobs sharing a prompt prefix on one
partition of their topic (short prompts keep their id's partition), and the workers'
consumer group runs the sticky assignor, so a consumer joining or leaving moves only the
partitions it must."""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from schemas import keys
from schemas.codec import decode_job
from worker.client import InflightClient
from worker.config import KafkaConfig
from worker.serve.sticky import StickyAssignor

SYSTEM = "You are the support agent of a hardware store. Answer in one sentence. " * 20  # 1420 bytes


async def read_all(bootstrap: str, topic: str, n: int) -> dict[str, int]:
    """job id -> partition of the first `n` records of `topic`."""
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest")
    await c.start()
    try:
        out: dict[str, int] = {}
        deadline = time.monotonic() + 30
        while len(out) < n and time.monotonic() < deadline:
            for tp, recs in (await c.getmany(timeout_ms=500)).items():
                for r in recs:
                    out[decode_job(r.value).job_id] = tp.partition
        return out
    finally:
        await c.stop()


def test_jobs_sharing_a_prefix_land_on_one_partition(services, prefix):
    async def main():
        kafka = KafkaConfig(bootstrap_servers=services[0], topic_prefix=prefix)
        async with InflightClient(kafka=kafka, redis_url=services[1], key_prefix=prefix) as client:
            ids = {"a": [], "b": [], "short": []}
            for i in range(12):
                ids["a"].append(await client.submit(messages=[{"role": "system", "content": SYSTEM},
                                                              {"role": "user", "content": f"question {i}"}]))
                ids["b"].append(await client.submit(messages=[{"role": "system", "content": SYSTEM.upper()},
                                                              {"role": "user", "content": f"question {i}"}]))
                ids["short"].append(await client.submit(f"hello {i}"))
        where = await read_all(services[0], keys.job_topic(prefix, "normal"), 36)
        return {k: {where[j] for j in v} for k, v in ids.items()}

    got = asyncio.run(main())
    assert len(got["a"]) == 1 and len(got["b"]) == 1, got  # one partition per prefix
    assert len(got["short"]) > 1, got  # no prefix: spread by job id, as before


def test_the_group_is_sticky_on_the_real_broker(services, prefix):
    """Three consumers, then one leaves: the two left keep what they had (KIP-54's aim)."""
    group = f"{prefix}-sticky"
    topics = [keys.job_topic(prefix, p) for p in keys.PRIORITIES]

    async def main():
        consumers = []

        async def start() -> AIOKafkaConsumer:
            c = AIOKafkaConsumer(*topics, bootstrap_servers=services[0], group_id=group,
                                 partition_assignment_strategy=StickyAssignor().strategy(),
                                 session_timeout_ms=6000, heartbeat_interval_ms=500)
            await c.start()
            consumers.append(c)
            return c

        async def settle(cs, n_parts: int):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                await asyncio.gather(*(c.getmany(timeout_ms=100) for c in cs))
                got = [set(c.assignment()) for c in cs]
                if sum(len(g) for g in got) == n_parts and len(set().union(*got)) == n_parts:
                    return got
            raise TimeoutError([c.assignment() for c in cs])

        try:
            a, b, c = await start(), await start(), await start()
            before = await settle([a, b, c], 9)
            admin = AIOKafkaAdminClient(bootstrap_servers=services[0])
            await admin.start()
            try:
                desc = (await admin.describe_consumer_groups([group]))[0].groups[0]
            finally:
                await admin.close()
            await c.stop()
            consumers.remove(c)
            after = await settle([a, b], 9)
            return before, after, desc[4]
        finally:
            for x in consumers:
                await x.stop()

    before, after, protocol = asyncio.run(main())
    assert protocol == "inflight-sticky"
    assert all(len([tp for tp in g if tp.topic == t]) == 1 for g in before for t in topics)  # 1 of each topic each
    assert before[0] <= after[0] and before[1] <= after[1], (before, after)  # nothing taken from a or b
