"""What the gateway answers itself, against the real broker: with no live worker it is
unready and a request is answered 503 at once with nothing produced (not a 429 after
`queue_timeout_s` that the SDK retries for 90 s), and serves again once a worker is up; a
prompt that cannot fit the model's context is a 400 with nothing produced and no DLQ
record (a client's mistake no longer pages)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
from aiokafka import AIOKafkaConsumer, TopicPartition

import worker.gateway.app as gateway_app
from schemas import keys
from tests.integration.conftest import worker_config
from tests.integration.gateway_helpers import MODEL, client, gateway_config, running_gateway, sample
from tests.integration.helpers import partitions_of, running_worker, slow_null_engine, wait_until


async def _readyz(gw) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{gw.port}/readyz") as r:
        return r.status, await r.json()


async def _end_offsets(bootstrap: str, topics: list[str]) -> dict:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await c.start()
    try:
        parts = [TopicPartition(t, p) for t in topics for p in sorted(await partitions_of(c, t))]
        return {(tp.topic, tp.partition): off for tp, off in (await c.end_offsets(parts)).items()}
    finally:
        await c.stop()


def test_no_live_worker_is_a_503_at_once_and_an_unready_gateway(services, prefix, tmp_path, monkeypatch):
    monkeypatch.setattr(gateway_app, "CHECK_INTERVAL_S", 0.3)  # the readiness loop's period
    cfg = worker_config(services, prefix)
    gcfg = gateway_config(services, prefix, tmp_path / "files", no_worker_grace_s=0.5, queue_timeout_s=30.0)
    request = dict(model=MODEL, prompt="hello", max_tokens=4)
    topics = keys.all_topics(prefix)

    async def _unready(gw):
        return (await _readyz(gw))[0] == 503

    async def _ready(gw):
        return (await _readyz(gw))[0] == 200

    async def main():
        out = {}
        async with running_gateway(gcfg) as gw:
            out["never_ran"] = await _readyz(gw)  # no worker ever: the group is unknown, nothing judged
            async with running_worker(cfg, slow_null_engine(0.01)):  # the fleet runs a job (its group commits)
                await wait_until(lambda: _ready(gw), 30, "ready once a worker joined")
                await client(gw).completions.create(**request)
            # every worker stopped
            await wait_until(lambda: _unready(gw), 15, "the gateway turns unready with no live worker")
            out["unready"] = await _readyz(gw)
            before = await _end_offsets(services[0], topics)
            t0 = time.monotonic()
            try:
                await client(gw).completions.create(**request)
                out["answer"] = None
            except openai.InternalServerError as e:
                out["answer"] = (e.status_code, e.body["code"], e.body["message"])
            out["took"] = time.monotonic() - t0
            out["produced"] = await _end_offsets(services[0], topics) != before
            out["gauge"] = sample(gw.metrics.registry, "gateway_live_workers", pool="default")
            async with running_worker(cfg, slow_null_engine(0.01)):
                await wait_until(lambda: _ready(gw), 30, "ready again once a worker joined")
                out["ready"] = await _readyz(gw)
                out["served"] = (await client(gw).completions.create(**request)).choices[0].finish_reason
                out["gauge_up"] = sample(gw.metrics.registry, "gateway_live_workers", pool="default")
        return out

    out = asyncio.run(main())
    # ready: an unknown group (or a first describe that found no coordinator yet) judges nothing
    assert out["never_ran"][0] == 200 and out["never_ran"][1]["live_workers"] in (None, {"default": None})
    status, body = out["unready"]
    assert status == 503 and body["checks"]["workers"] is False and body["live_workers"] == {"default": 0}
    assert body["errors"]["workers"] == f"no live worker for model '{MODEL}' (pool 'default')"
    code, err, message = out["answer"]
    assert (code, err) == (503, "no_live_worker") and f"model '{MODEL}' (pool 'default')" in message
    assert out["took"] < 1.0, out["took"]  # at once, not after queue_timeout_s
    assert not out["produced"]  # no job, no cancel: nothing reached Kafka
    assert out["gauge"] == 0
    assert out["ready"][0] == 200 and out["ready"][1]["live_workers"] == {"default": 1}
    assert out["served"] in ("length", "stop") and out["gauge_up"] == 1


def test_a_prompt_that_cannot_fit_is_a_400_with_nothing_produced(services, prefix, llama_path, tmp_path):
    gcfg = gateway_config(services, prefix, tmp_path / "files", tokenizer=llama_path, no_worker_grace_s=600.0)
    topics = keys.all_topics(prefix)  # the job topics, the cancel topic and the DLQ among them
    long_text = "word " * 1100  # the tiny model's context is 1024 tokens (its config.json)

    async def main():
        async with running_gateway(gcfg) as gw:
            before = await _end_offsets(services[0], topics)
            answers = {}
            for name, call in (
                    ("chat", lambda c: c.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=4)),
                    ("completion", lambda c: c.completions.create(model=MODEL, prompt=long_text, max_tokens=4)),
                    ("room", lambda c: c.completions.create(model=MODEL, prompt="word " * 500, max_tokens=600))):
                t0 = time.monotonic()
                try:
                    await call(client(gw))
                except openai.BadRequestError as e:
                    answers[name] = (e.status_code, e.body["code"], e.body["param"], time.monotonic() - t0)
            return answers, await _end_offsets(services[0], topics) == before

    answers, unchanged = asyncio.run(main())
    assert {k: v[:3] for k, v in answers.items()} == {
        "chat": (400, "context_length_exceeded", "messages"), "completion": (400, "context_length_exceeded", "prompt"),
        "room": (400, "context_length_exceeded", "prompt")}  # 500 prompt tokens + 600 to generate
    assert all(v[3] < 1.0 for v in answers.values())
    assert unchanged  # no job, no cancel, no DLQ record
