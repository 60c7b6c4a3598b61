"""Fleet liveness at the gateway against the real broker: with no live worker the gateway
is unready and a request is answered 503 at once with nothing produced (not a 429 after
`queue_timeout_s` that the SDK retries for 90 s); with a worker up again it serves."""

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

    async def main():
        out = {}
        async with running_gateway(gcfg) as gw:
            await wait_until(lambda: _unready(gw), 15, "the gateway turns unready with no worker")
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

    async def _unready(gw):
        return (await _readyz(gw))[0] == 503

    async def _ready(gw):
        return (await _readyz(gw))[0] == 200

    out = asyncio.run(main())
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
