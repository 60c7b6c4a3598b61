"""deploy/compose.yaml for real (with deploy/compose.local.yaml's local images and host
networking): the order of the tests matters (the last ones restart Redis and stop the
worker)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
import redis

from schemas.wire import SamplingParams, Token
from tests.deploy.conftest import (
    API_KEY,
    GATEWAY,
    KAFKA,
    PROMETHEUS,
    REDIS,
    ROOT,
    WORKER_HTTP,
    container,
    exit_code,
    http_get,
    podman,
    record,
    run,
    running,
    wait_for,
)
from worker.client import InflightClient

pytestmark = pytest.mark.usefixtures("stack")


def test_preflight_passes_in_the_worker_container(stack):
    p = stack["preflight"]
    assert p.returncode == 0, p.stdout + p.stderr
    assert "FAIL" not in p.stdout and "PASS  model" in p.stdout, p.stdout


def test_cli_job_from_the_host_streams_back(stack):
    p = run(str(ROOT / ".venv" / "bin" / "inflight"), "submit", "--kafka", KAFKA, "--redis", REDIS,
            "--prompt", "Return the sum of", "--max-tokens", "12", "--stream", "--timeout", "120", timeout=180)
    assert "[finished: length" in p.stderr, p.stderr
    assert p.stdout.strip(), "no token text streamed"
    record("first_job_served_s", round(time.monotonic() - stack["t0"], 1))


def test_openai_chat_through_the_gateway_container():
    from openai import OpenAI

    client = OpenAI(base_url=GATEWAY + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["model"]
    r = client.chat.completions.create(model="model", messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="model", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finishes == ["length"]
    # the files volume (Batch API uploads) is writable by the gateway's non-root user
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}})
    uploaded = client.files.create(file=("batch.jsonl", (line + "\n").encode()), purpose="batch")
    assert client.files.content(uploaded.id).read() == (line + "\n").encode()


def test_prometheus_scrapes_the_worker_and_the_gateway_with_the_alert_rules():
    def targets():
        status, body = http_get(PROMETHEUS + "/api/v1/targets")
        active = json.loads(body)["data"]["activeTargets"] if status == 200 else []
        up = {t["labels"]["job"] for t in active if t["health"] == "up"}
        return up >= {"inflight-worker", "inflight-gateway"} and up

    wait_for("prometheus targets up", targets, 60, 2, logs_of=container("prometheus"))
    status, body = http_get(PROMETHEUS + "/api/v1/rules")
    groups = json.loads(body)["data"]["groups"]
    assert status == 200 and sum(len(g["rules"]) for g in groups) > 0
    status, body = http_get(PROMETHEUS + "/api/v1/query?query=request_finished_total")
    assert status == 200 and json.loads(body)["data"]["result"], body[:500]
    status, body = http_get(WORKER_HTTP + "/metrics")
    assert status == 200 and b"llm_ttft_seconds_bucket" in body


def test_redis_keeps_its_data_across_a_container_restart():
    r = redis.Redis.from_url(REDIS)
    r.set("deploy-check:kept", "yes")
    keys_before = len(r.keys("inflight*"))
    assert keys_before > 0  # the jobs above left their logs and results
    podman("restart", "-t", "10", container("redis"), timeout=60)
    wait_for("redis back", lambda: redis.Redis.from_url(REDIS).ping(), 30)
    r = redis.Redis.from_url(REDIS)
    assert r.get("deploy-check:kept") == b"yes"
    assert len(r.keys("inflight*")) >= keys_before
    assert r.config_get("appendonly")["appendonly"] == "yes"


def test_a_job_after_the_redis_restart_and_the_worker_drains_on_stop():
    """SIGTERM reaches `inflight worker` (PID 1 of its container): it drains for its
    drain timeout (2 s here), hands back the jobs still running, exits 0; the restarted
    worker runs them again from the start (attempt 2) to their full length."""

    async def main():
        async with InflightClient(KAFKA, REDIS) as client:
            first = await client.submit("After the Redis restart:", params=SamplingParams(max_tokens=8, temperature=0))
            assert (await client.result(first, timeout_s=120)).finish_reason == "length"
            params = SamplingParams(max_tokens=1000, temperature=0)
            ids = [await client.submit(f"Job {i} of the drain test:", params=params) for i in range(8)]
            for j in ids:  # all of them running before the stop
                async with contextlib.aclosing(client.stream(j, timeout_s=120)) as events:
                    async for ev in events:
                        if isinstance(ev, Token):
                            break
            t0 = time.monotonic()
            p = podman("stop", "-t", "90", container("worker"), timeout=120)
            stop_s = time.monotonic() - t0
            assert not running(container("worker")), p.stdout + p.stderr
            logs = podman("logs", container("worker"))
            out = logs.stdout + logs.stderr
            assert exit_code(container("worker")) == 0, out[-3000:]
            assert "draining" in out and "handed back unfinished jobs" in out, out[-3000:]
            podman("start", container("worker"))
            results = [await client.result(j, timeout_s=300) for j in ids]
            assert all(r.finish_reason == "length" and r.usage.completion_tokens == 1000 for r in results), results
            assert any(r.attempt == 2 for r in results), [r.attempt for r in results]
            record("worker_stop_s", round(stop_s, 1))

    asyncio.run(main())
    wait_for("worker ready again", lambda: http_get(WORKER_HTTP + "/readyz")[0] == 200, 240,
             logs_of=container("worker"))


def test_gateway_stops_cleanly():
    podman("stop", "-t", "40", container("gateway"), timeout=60)
    assert exit_code(container("gateway")) == 0, podman("logs", "--tail", "40", container("gateway")).stderr
    podman("start", container("gateway"))

