"""Pools by prompt length on the dev stack (schemas/pools.py, worker/serve/pool_router.py):
`default` up to 256 prompt tokens with a small KV budget, `long` up to 4096. Jobs produced
by a client that counts tokens land on their pool's topics; jobs produced to the default
topics by a producer that does not count (kcat) are forwarded by a default worker to the
long pool and finish there, with one `started` and one terminal event; a prompt longer
than every pool is one `rejected` event and one DLQ record; a short job on the long pool's
topic goes back to the default pool; a default worker killed between a forward's
acknowledgement and its commit loses nothing and runs nothing twice.

The engines are model-less (`null_engine`: its tokenizer spells one token per character),
so a prompt's length in characters is its length in tokens."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import time

import msgspec
import yaml
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import keys
from schemas.pools import Pool, Pools
from schemas.wire import Finished, Restarted, Started
from tests.integration.conftest import worker_config
from tests.integration.helpers import (
    assert_well_formed,
    collect,
    committed_reaches_end,
    partitions_of,
    running_worker,
    wait_until,
)
from tests.integration.test_worker_faults import read_dlq
from worker.cli.topics import create_topics
from worker.client import InflightClient
from worker.config import EngineConfig
from worker.model.null_runner import LetterTokenizer, NullRunner, null_engine

POOLS = [Pool(name="default", max_prompt_tokens=256), Pool(name="long", max_prompt_tokens=4096)]
CONTEXT = 8192


def pool_engine(cfg, device_ms: float = 1.0):
    """A model-less engine for `cfg`'s pool: context 8192, steps of `device_ms` on an
    emulated device (jobs last long enough to be seen running)."""
    eng = null_engine(EngineConfig(serving_tuning=cfg.serving_tuning), vocab_size=100, max_model_len=CONTEXT,
                      device_ms=device_ms)
    eng.runner = NullRunner(100, avoid=frozenset({0}), device_ms=device_ms)
    return eng


def pool_configs(services, prefix):
    default = worker_config(services, prefix, pools=POOLS, worker={"worker_id": "w-default", "pool": "default"},
                            tuning={"max_total_tokens": 1024, "max_input_tokens": 256, "max_output_tokens": 64})
    long = worker_config(services, prefix, pools=POOLS, worker={"worker_id": "w-long", "pool": "long"},
                         tuning={"max_total_tokens": 16384, "max_input_tokens": 4096, "max_output_tokens": 64,
                                 "max_batched_tokens": 1024})
    return default, long


async def produce_raw(bootstrap: str, topic: str, jobs: list[dict]) -> None:
    """A producer that counts no tokens: kcat when installed (as an operator's shell
    would), else aiokafka with the same bytes."""
    if shutil.which("kcat"):
        for job in jobs:
            await asyncio.to_thread(subprocess.run, ["kcat", "-P", "-b", bootstrap, "-t", topic, "-k", job["job_id"]],
                                    input=msgspec.json.encode(job), check=True, timeout=30)
        return
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for job in jobs:
            await producer.send_and_wait(topic, msgspec.json.encode(job), key=job["job_id"].encode())
    finally:
        await producer.stop()


async def end_offsets(bootstrap: str, topics: list[str]) -> int:
    """Records ever written to `topics` (the sum of their partitions' end offsets)."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await c.start()
    try:
        tps = [TopicPartition(t, p) for t in topics for p in sorted(await partitions_of(c, t))]
        return sum((await c.end_offsets(tps)).values())
    finally:
        await c.stop()


def job(job_id: str, length: int, max_tokens: int = 8) -> dict:
    return {"job_id": job_id, "prompt": "a" * length, "params": {"max_tokens": max_tokens, "ignore_eos": True}}


def ran_once_on(events: list, job_id: str, worker_id: str) -> Finished:
    fin = assert_well_formed(events, job_id)
    started = [e for e in events if isinstance(e, Started)]
    assert len(started) == 1 and started[0].worker_id == worker_id, [(type(e).__name__) for e in events]
    return fin


def test_jobs_run_in_the_pool_their_prompt_length_belongs_to(services, prefix):
    asyncio.run(create_topics(services[0], prefix, partitions=3, pools=Pools(POOLS)))
    cfg_default, cfg_long = pool_configs(services, prefix)
    long_topics = keys.job_topics(prefix, "long")

    async def main():
        async with running_worker(cfg_default, pool_engine(cfg_default)) as wd, \
                running_worker(cfg_long, pool_engine(cfg_long)) as wl, \
                InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix, pools=POOLS,
                               tokenizer=LetterTokenizer()) as client:
            before = await end_offsets(services[0], long_topics)
            # 1. a client that counts: straight to the right pool
            short_ids = [await client.submit("s" * 20, job_id=f"short-{i}", params=None) for i in range(3)]
            long_ids = [await client.submit("l" * 300, job_id=f"long-{i}") for i in range(3)]
            direct = {j: await collect(client, j, 60) for j in short_ids + long_ids}
            after_client = await end_offsets(services[0], long_topics)
            # 2. a producer that does not count: to the default pool, which forwards
            await produce_raw(services[0], keys.job_topic(prefix, "normal"), [job(f"kcat-{i}", 300) for i in range(2)])
            # 3. longer than every pool; 4. short, on the long pool's topic
            await produce_raw(services[0], keys.job_topic(prefix, "normal"), [job("huge", 5000)])
            await produce_raw(services[0], keys.job_topic(prefix, "high", "long"), [job("back", 10)])
            forwarded = {j: await collect(client, j, 60) for j in ("kcat-0", "kcat-1", "back")}
            huge = await collect(client, "huge", 60)
            dlq = await read_dlq(services[0], prefix, 1)
            committed = [await committed_reaches_end(services[0], cfg.job_group_id, prefix, pool=cfg.worker.pool)
                         for cfg in (cfg_default, cfg_long)]
            after = await end_offsets(services[0], long_topics)
            counts = {w.cfg.worker.pool: _forwards(w) for w in (wd, wl)}
        return before, after_client, after, direct, forwarded, huge, dlq, committed, counts

    before, after_client, after, direct, forwarded, huge, dlq, committed, counts = asyncio.run(main())
    for j, evs in direct.items():
        fin = ran_once_on(evs, j, "w-long" if j.startswith("long") else "w-default")
        assert fin.finish_reason == "length" and not any(isinstance(e, Restarted) for e in evs)
    assert after_client - before == 3  # the client wrote the long jobs to the long pool's topics
    for j in ("kcat-0", "kcat-1"):
        fin = ran_once_on(forwarded[j], j, "w-long")
        assert fin.usage.prompt_tokens == 300 and fin.attempt == 1
        assert not any(isinstance(e, Restarted) for e in forwarded[j])  # the forward undid its attempt
    assert ran_once_on(forwarded["back"], "back", "w-default").finish_reason == "length"
    assert after - after_client == 3  # "back", and the two kcat jobs the default worker forwarded there
    assert counts == {"default": {"long": 2.0}, "long": {"default": 1.0}}
    (fin,) = [e for e in huge if isinstance(e, Finished)]
    assert len(huge) == 1 and fin.finish_reason == "rejected" and fin.error.code == "prompt_too_long"
    assert "longest any pool serves is 4096" in fin.error.message
    assert [(dict(r.headers)["inflight.reason"], r.key) for r in dlq] == [(b"prompt_too_long", b"huge")]
    for c in committed:
        assert all(a == b for a, b in c.values()), c


def _forwards(w) -> dict:
    """The worker's non-zero `jobs_forwarded_total` samples: {to_pool: count}."""
    return {s.labels["to_pool"]: s.value for metric in w.metrics.forwarded.collect() for s in metric.samples
            if s.name.endswith("_total") and s.value}


def test_a_worker_killed_between_a_forward_and_its_commit_loses_nothing_and_runs_nothing_twice(
        services, prefix, tmp_path):
    from tests.integration.processes import spawn_worker, wait_started

    asyncio.run(create_topics(services[0], prefix, partitions=3, pools=Pools(POOLS)))
    cfg_default, cfg_long = pool_configs(services, prefix)
    proc, log = spawn_worker(tmp_path, cfg_default, "w-default", command=("tests.integration.forward_crash_worker",))

    async def main():
        async with running_worker(cfg_long, pool_engine(cfg_long)), \
                InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            await wait_started(log, proc)
            await produce_raw(services[0], keys.job_topic(prefix, "low"), [job("crash-fwd", 400, max_tokens=16)])
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            # forwarded and acknowledged, then killed: claim not given back, offset not committed
            async with running_worker(cfg_default, pool_engine(cfg_default)):  # reads the record again
                events = await collect(client, "crash-fwd", 90)
                committed = [await committed_reaches_end(services[0], cfg.job_group_id, prefix, pool=cfg.worker.pool,
                                                         timeout=30) for cfg in (cfg_default, cfg_long)]
        return events, committed

    try:
        events, committed = asyncio.run(main())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-2000:]
    fin = ran_once_on(events, "crash-fwd", "w-long")
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == 16
    for c in committed:
        assert all(a == b for a, b in c.values()), c


def test_the_gateway_and_the_cli_route_by_the_tokenizers_count(services, prefix, tmp_path, llama_path):
    """The gateway with the pools section and the model's tokenizer produces a chat
    request to the pool that serves its prompt, and so does `inflight submit --config` with
    the pools section and `model.path`: no worker forwards anything."""
    from transformers import AutoTokenizer

    from tests.integration.gateway_helpers import client, gateway_config, running_gateway, sample

    asyncio.run(create_topics(services[0], prefix, partitions=3, pools=Pools(POOLS)))
    cfg_default, cfg_long = pool_configs(services, prefix)
    tok = AutoTokenizer.from_pretrained(llama_path)

    def engine(cfg):  # the model's tokenizer, so the workers count as the gateway does
        eng = null_engine(EngineConfig(serving_tuning=cfg.serving_tuning), vocab_size=len(tok), max_model_len=CONTEXT,
                          tokenizer=tok, device_ms=1.0)
        eng.runner = NullRunner(len(tok), avoid=frozenset(tok.all_special_ids), device_ms=1.0)
        return eng

    long_text = "the quick brown fox jumps over the lazy dog " * 60
    assert len(tok(long_text).input_ids) > 300

    async def main():
        gcfg = gateway_config(services, prefix, tmp_path / "files", tokenizer=llama_path)
        gcfg = msgspec.structs.replace(gcfg, pools=POOLS)
        async with running_worker(cfg_default, engine(cfg_default)) as wd, \
                running_worker(cfg_long, engine(cfg_long)) as wl, running_gateway(gcfg) as gw:
            c = client(gw)
            for text in ("hello there", long_text):
                r = await c.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": text}],
                                                    max_tokens=4, temperature=0)
                assert r.choices[0].finish_reason == "length"
            # the CLI with the pools section and the model's path: the same routing
            cfg_file = tmp_path / "cli.yaml"
            cfg_file.write_text(yaml.safe_dump({
                "model": {"path": str(llama_path)}, "pools": [msgspec.to_builtins(p) for p in POOLS],
                "kafka": {"bootstrap_servers": services[0], "topic_prefix": prefix},
                "redis": {"url": services[1], "key_prefix": prefix}}))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "worker", "submit", "--config", str(cfg_file), "--prompt", long_text,
                "--max-tokens", "4", "--stream", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            async with asyncio.timeout(120):
                _, err = await proc.communicate()
            assert proc.returncode == 0 and b"[finished: length" in err, err.decode()[-2000:]
            await wait_until(lambda: sum(sample(w.metrics.registry, "request_finished_total", finish_reason="length")
                                         for w in (wd, wl)) >= 3, 10, "the three jobs counted as finished")
            return {w.cfg.worker.pool: (sample(w.metrics.registry, "request_finished_total", finish_reason="length"),
                                       _forwards(w))
                    for w in (wd, wl)}

    assert asyncio.run(main()) == {"default": (1.0, {}), "long": (2.0, {})}


def test_a_worker_stopped_while_forwarding_hands_every_job_on_as_attempt_1(services, prefix):
    """SIGTERM (a drain) of a default worker with forwards still queued: the drain waits
    for them (and gives back the claims of any it could not send), so every job runs once
    on the long pool as attempt 1 — none waits out a lease and runs alone as if its worker
    had crashed (the drain used to stop with forwards queued: their claims ran out)."""
    from tests.integration.helpers import start_worker, stop_worker

    asyncio.run(create_topics(services[0], prefix, partitions=3, pools=Pools(POOLS)))
    cfg_default, cfg_long = pool_configs(services, prefix)
    ids = [f"drain-{i}" for i in range(30)]

    async def main():
        async with running_worker(cfg_long, pool_engine(cfg_long)), \
                InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            w, task = await start_worker(cfg_default, pool_engine(cfg_default))
            producer = AIOKafkaProducer(bootstrap_servers=services[0], acks="all")
            await producer.start()
            try:
                for j in ids:
                    await producer.send(keys.job_topic(prefix, "normal"), msgspec.json.encode(job(j, 300)),
                                        key=j.encode())
                await producer.flush()
            finally:
                await producer.stop()
            deadline = time.monotonic() + 30
            while not _forwards(w) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            await stop_worker(w, task)  # forwards queued behind the first
            # records it never read go to the next default worker
            async with running_worker(cfg_default, pool_engine(cfg_default)):
                return {j: await collect(client, j, 90) for j in ids}

    events = asyncio.run(main())
    for j, evs in events.items():
        fin = ran_once_on(evs, j, "w-long")
        assert fin.attempt == 1 and fin.finish_reason == "length", (j, fin)
        assert not any(isinstance(e, Restarted) for e in evs), j
