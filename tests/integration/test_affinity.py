"""Prefix affinity on the real broker: the client puts jobs sharing a prompt prefix on one
partition of their topic (short prompts keep their id's partition), and the workers'
consumer group runs the sticky assignor, so a consumer joining or leaving moves only the
partitions it must."""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor

from schemas import keys
from schemas.codec import decode_job
from schemas.params import SamplingParams
from tests.integration.conftest import worker_config
from tests.integration.helpers import assert_well_formed, collect, committed_reaches_end, wait_group_members
from tests.integration.processes import kill_9, spawn_worker, wait_for_starts, wait_started
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


def test_kill_9_under_the_affinity_workload_loses_nothing_and_hits_come_back(services, prefix, llama_path, tmp_path):
    """Two workers, two shared prefixes; one worker is killed mid-wave: every job finishes
    once, and the next wave's jobs hit the prefix cache of the worker left (each prefix
    computed there once more at most)."""
    system = [f"Prompt {k}. " + "Answer the customer's question about their order politely. " * 18 for k in (1, 2)]
    cfg = worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu"},
                        tuning={"max_running_requests": 2}, worker={"max_local_jobs": 4})
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    a, a_log = spawn_worker(tmp_path, cfg, "worker-a")
    b, b_log = spawn_worker(tmp_path, cfg, "worker-b")
    try:
        async def wave(client, name: str) -> list[str]:
            ids = [f"{name}-{i}" for i in range(12)]
            for i, j in enumerate(ids):
                await client.submit(f"{system[i % 2]}\nQuestion {name} {i}?", params=params, job_id=j)
            return ids

        async def main():
            await asyncio.gather(wait_started(a_log, a), wait_started(b_log, b))
            await wait_group_members(services[0], cfg.kafka.group_id, 2)
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
                first = await wave(client, "w1")
                await wait_for_starts(client, first, "worker-a", 1)
                kill_9(a)
                killed_at = time.monotonic()
                results = await asyncio.gather(*(collect(client, j, 180) for j in first))
                second = await wave(client, "w2")
                later = await asyncio.gather(*(collect(client, j, 180) for j in second))
                recovered_s = time.monotonic() - killed_at
            committed = await committed_reaches_end(services[0], cfg.kafka.group_id, prefix, timeout=30)
            return first, results, second, later, committed, recovered_s

        first, results, second, later, committed, recovered_s = asyncio.run(main())
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()
    for j, evs in [*zip(first, results), *zip(second, later)]:
        fin = assert_well_formed(evs, j)
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 30
    assert all(c == e for c, e in committed.values()), committed
    hits = [assert_well_formed(evs, j).usage.cached_prompt_tokens > 0 for j, evs in zip(second, later)]
    assert sum(hits) >= len(second) - 2, hits  # each prefix recomputed at most once on the worker left
    assert recovered_s < 60, recovered_s


def test_a_worker_the_group_refuses_for_its_assignor_stops_with_a_config_error(services, prefix, llama_path, tmp_path):
    """A group still on round-robin (workers from before): a sticky worker cannot join
    (aiokafka offers one protocol), and says which setting to change, exit 2."""
    cfg = worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu"})
    topics = [keys.job_topic(prefix, p) for p in keys.PRIORITIES]

    async def main():
        old = AIOKafkaConsumer(*topics, bootstrap_servers=services[0], group_id=cfg.kafka.group_id,
                               partition_assignment_strategy=(RoundRobinPartitionAssignor,))
        await old.start()
        try:
            await old.getmany(timeout_ms=500)
            proc, log = spawn_worker(tmp_path, cfg, "worker-new")
            rc = await asyncio.to_thread(proc.wait, 120)
            return rc, log.read_text()
        finally:
            await old.stop()

    rc, text = asyncio.run(main())
    assert rc == 2, text[-2000:]
    assert "kafka.partition_assignor is 'sticky'" in text and "roundrobin" in text, text[-2000:]
