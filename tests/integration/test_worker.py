"""The main job end to end on the real Kafka and Redis, one in-process worker."""

from __future__ import annotations

import asyncio
import random

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas import keys
from schemas.params import SamplingParams
from schemas.wire import Finished, Started, Token
from tests.integration.conftest import worker_config
from tests.integration.helpers import (
    assert_well_formed,
    collect,
    committed_reaches_end,
    kinds,
    start_worker,
    stop_worker,
    token_ids,
)
from worker.client import InflightClient
from worker.engine import Engine

PRIOS = ("high", "normal", "low")


@pytest.fixture(scope="module")
def engine_factory(llama_path):
    def make(cfg):
        return Engine.from_pretrained(str(llama_path), cfg.engine)

    return make


def test_fifty_jobs_over_three_priorities(services, prefix, engine_factory):
    cfg = worker_config(services, prefix)
    engine = engine_factory(cfg)
    prompts = [f"Job {i}: the module provides" for i in range(50)]
    params = [SamplingParams(temperature=0, max_tokens=1 + (7 * i) % 24) for i in range(50)]

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            ids = [await client.submit(p, params=sp, priority=PRIOS[i % 3], job_id=f"job-{i}")
                   for i, (p, sp) in enumerate(zip(prompts, params))]
            results = await asyncio.gather(*(collect(client, j) for j in ids))
        committed = await committed_reaches_end(services[0], cfg.kafka.group_id, prefix)
        await stop_worker(w, task)
        return ids, results, committed

    ids, results, committed = asyncio.run(main())
    reference = engine.generate(prompts, params)  # the engine alone, same model
    for jid, events, ref in zip(ids, results, reference):
        fin = assert_well_formed(events, jid)
        assert isinstance(events[0], Started) and events[0].attempt == 1
        assert any(isinstance(e, Token) for e in events)
        assert fin.finish_reason in ("stop", "length")
        assert token_ids(events) == ref.token_ids
        assert fin.text == ref.text == "".join(e.text for e in events if isinstance(e, Token))
        assert fin.usage.completion_tokens == len(ref.token_ids)
    assert all(c == e for c, e in committed.values()), committed


def test_cancellation(services, prefix, engine_factory):
    cfg = worker_config(services, prefix, tuning={"max_output_tokens": 1000})
    engine = engine_factory(cfg)
    # cancelled after 3 tokens: as long as the context allows, so that no machine finishes it
    # before the cancel arrives (250 tokens took 0.15 s on a fast box)
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            # 1. a running job: cancelled mid-stream, KV freed
            jid = await client.submit("Cancel me while I run", params=long, job_id="running")
            events = []
            async for ev in client.stream(jid, timeout_s=60):
                events.append(ev)
                if isinstance(ev, Token) and len(events) == 3:
                    await client.cancel(jid)
            fin = assert_well_formed(events, jid)
            assert fin.finish_reason == "cancelled"
            assert fin.usage.completion_tokens < 1000
            assert engine.kv.block_table(jid) == []  # freed at the step boundary that ended it

            # 2. cancelled before it is consumed: it never runs
            await client.cancel("early")
            await client.submit("never runs", params=long, job_id="early")
            early = await collect(client, "early", 60)
            assert kinds(early) == ["Finished"] and early[0].finish_reason == "cancelled"

            # 3. cancel of a finished job and of an unknown id: no effect
            await client.submit("short one", params=SamplingParams(temperature=0, max_tokens=3), job_id="done")
            done = await collect(client, "done", 60)
            await client.cancel("done")
            await client.cancel("no-such-job")
            await asyncio.sleep(1.0)
            assert kinds(await client.read_log("done")) == kinds(done)
            assert done[-1].finish_reason in ("stop", "length")

            # 4. 200 jobs with cancels timed around their completion
            rnd = random.Random(7)
            ids = [f"race-{i}" for i in range(200)]
            for i, j in enumerate(ids):
                await client.submit(f"race {i}", params=SamplingParams(temperature=0, max_tokens=rnd.randint(1, 12)),
                                    job_id=j, priority=PRIOS[i % 3])

            async def cancel_later(j):
                await asyncio.sleep(rnd.random() * 1.5)
                await client.cancel(j)

            await asyncio.gather(*(cancel_later(j) for j in ids))
            results = await asyncio.gather(*(collect(client, j, 120) for j in ids))
            for j, evs in zip(ids, results):
                f = assert_well_formed(evs, j)
                assert f.finish_reason in ("stop", "length", "cancelled")
            # still healthy
            await client.submit("after the storm", params=SamplingParams(temperature=0, max_tokens=2), job_id="after")
            after = await collect(client, "after", 60)
            assert after[-1].finish_reason in ("stop", "length")
        await stop_worker(w, task)
        assert engine.kv_stats().used_blocks == 0
        engine.check_invariants()

    asyncio.run(main())


def test_poison_records_go_to_dlq_and_never_block(services, prefix, engine_factory):
    cfg = worker_config(services, prefix)
    engine = engine_factory(cfg)
    topic = keys.job_topic(prefix, "normal")
    poison = [
        (b"p-notjson", b"this is not json"),
        (b"p-types", b'{"job_id": 42, "prompt": "x"}'),
        (b"p-missing", b'{"prompt": "no job id"}'),
        (b"p-version", b'{"v": 9, "job_id": "bad-version", "prompt": "x"}'),
        (b"p-big", b'{"job_id": "huge", "prompt": "' + b"x" * (10 * 1024 * 1024) + b'"'),
        (b"p-unicode", '{"job_id": "jöb-ünïcode-€", "prompt": "x"}'.encode()),  # an id the wire refuses
    ]

    async def main():
        producer = AIOKafkaProducer(bootstrap_servers=services[0], max_request_size=16 * 1024 * 1024)
        await producer.start()
        good = []
        for i, (key, value) in enumerate(poison):  # same partition as the good jobs around them
            for k in (key, f"good-{i}".encode()):
                if k.startswith(b"good"):
                    job = {"job_id": k.decode(), "prompt": f"good job {i}", "params": {"max_tokens": 3, "temperature": 0}}
                    import json

                    await producer.send_and_wait(topic, json.dumps(job).encode(), key=k, partition=0)
                    good.append(k.decode())
                else:
                    await producer.send_and_wait(topic, value, key=key, partition=0)
        await producer.stop()
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            results = await asyncio.gather(*(collect(client, j, 90) for j in good))
            rejected = await collect(client, "bad-version", 30)
            # its raw producer waits on the id it sent: it hears why (issue 50)
            unicode_id = await collect(client, "jöb-ünïcode-€", 30)
            # no readable job_id: answered under the record's key, a valid job id (issue 32)
            by_key = await asyncio.gather(*(collect(client, k, 30) for k in ("p-notjson", "p-types", "p-missing")))
        committed = await committed_reaches_end(services[0], cfg.kafka.group_id, prefix)
        dlq = AIOKafkaConsumer(keys.dlq_topic(prefix), bootstrap_servers=services[0], group_id=None,
                               auto_offset_reset="earliest", max_partition_fetch_bytes=32 * 1024 * 1024,
                               fetch_max_bytes=64 * 1024 * 1024)
        await dlq.start()
        dead = []
        for _ in range(50):
            batch = await dlq.getmany(timeout_ms=500)
            dead.extend(r for rs in batch.values() for r in rs)
            if len(dead) >= len(poison):
                break
        await dlq.stop()
        await stop_worker(w, task)
        return good, results, rejected, committed, dead, w, by_key, unicode_id

    good, results, rejected, committed, dead, w, by_key_events, unicode_id = asyncio.run(main())
    fin_u = assert_well_formed(unicode_id, "jöb-ünïcode-€")
    assert len(unicode_id) == 1 and fin_u.finish_reason == "rejected" and fin_u.error.code == "invalid_job"
    assert "job_id" in fin_u.error.message
    for k, evs in zip(("p-notjson", "p-types", "p-missing"), by_key_events):
        fin_k = assert_well_formed(evs, k)
        assert len(evs) == 1 and fin_k.finish_reason == "rejected" and fin_k.error.code == "invalid_job", (k, evs)
    for j, evs in zip(good, results):
        assert assert_well_formed(evs, j).finish_reason in ("stop", "length")
    fin = assert_well_formed(rejected, "bad-version")
    assert fin.finish_reason == "rejected" and fin.error.code == "invalid_job"
    assert "v" in fin.error.message
    assert sorted(r.key for r in dead) == sorted(k for k, _ in poison)
    by_key = {r.key: r for r in dead}
    assert by_key[b"p-big"].value == poison[4][1]  # original bytes, untouched
    headers = dict(by_key[b"p-types"].headers)
    assert b"job_id" in headers["inflight.error"] and headers["inflight.source.topic"] == topic.encode()
    assert w.dead_letters.num_sent == len(poison)
    assert all(c == e for c, e in committed.values()), committed


def test_late_subscriber_gets_the_whole_sequence(services, prefix, engine_factory):
    cfg = worker_config(services, prefix)
    engine = engine_factory(cfg)

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            await client.submit("late", params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), job_id="late")
            for _ in range(300):
                if await client.redis.exists(keys.done_key("late", prefix)):
                    break
                await asyncio.sleep(0.1)
            raw = await client.redis.xrange(keys.log_key("late", prefix))
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as late_client:
            events = await collect(late_client, "late", 10)
        await stop_worker(w, task)
        return events, raw

    events, raw = asyncio.run(main())
    # what it read was the compacted log (redis.compact_logs): started, one run, finished
    sizes = raw[1][1].get(b"s")
    assert len(raw) == 3 and len(kinds(events)) - 2 == (len(sizes.split(b",")) if sizes else 1)
    fin = assert_well_formed(events, "late")
    assert kinds(events)[0] == "Started"
    assert len(token_ids(events)) == 12
    assert fin.text == "".join(e.text for e in events if isinstance(e, Token))
    assert isinstance(fin, Finished) and fin.finish_reason == "length"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculating_worker_streams_every_kept_token_in_order(services, prefix, engine_factory, method):
    """Prompt lookup, or a draft model, on (serving_tuning.speculative): a step may give a
    job several tokens; the stream carries them all, seq unbroken, and the ids are the
    engine's without it."""
    from tests.conftest import draft_checkpoint
    from worker.config import SpeculativeConfig

    spec = SpeculativeConfig(method=method, prompt_lookup_min=1, min_accepted_tokens=0.0, min_speedup=None,
                             draft_model=str(draft_checkpoint("llama")) if method == "draft" else None)
    cfg = worker_config(services, prefix, tuning={"speculative": spec})
    engine = engine_factory(cfg)
    prompts = [f"Job {i}: the module provides the module provides the module" for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=24 + i, ignore_eos=True) for i in range(5)]
    params.append(SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True, stop=["the"]))

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            ids = [await client.submit(p, params=sp, job_id=f"spec-{i}") for i, (p, sp) in
                   enumerate(zip(prompts, params))]
            results = await asyncio.gather(*(collect(client, j) for j in ids))
        await stop_worker(w, task)
        return ids, results

    ids, results = asyncio.run(main())
    assert engine.scheduler.speculation.stats.num_accepted_tokens > 0
    plain = worker_config(services, prefix).engine  # the same engine settings, speculation off
    reference = Engine.from_pretrained(engine.config.model.path, plain).generate(prompts, params)
    for jid, events, ref in zip(ids, results, reference):
        fin = assert_well_formed(events, jid)
        assert token_ids(events) == ref.token_ids
        assert fin.text == ref.text == "".join(e.text for e in events if isinstance(e, Token))
        assert fin.usage.completion_tokens == len(ref.token_ids)
    assert any(len(e.token_ids) > 1 for ev in results for e in ev if isinstance(e, Token))  # a step's run, streamed
