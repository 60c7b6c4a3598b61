"""Operations on the real Kafka and Redis: /metrics values after a scripted workload,
the job summary log, an injected OOM inside a running worker, and /readyz following
Kafka, Redis and drain."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import time

import aiohttp
import pytest
import torch
from aiokafka import AIOKafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from schemas import keys
from schemas.params import SamplingParams
from schemas.wire import Finished, Token
from tests.integration.conftest import ROOT, worker_config
from tests.integration.helpers import (
    assert_well_formed,
    collect,
    create_and_see_topics,
    finished_within,
    start_worker,
    stop_worker,
    wait_until,
)
from worker.client import InflightClient
from worker.engine import Engine
from worker.obs.log import setup_logging


async def scrape(w) -> dict[tuple[str, tuple], float]:
    """GET /metrics of a worker: {(sample name, sorted labels): value}."""
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{w.server.port}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


async def finished_both(w) -> dict | None:
    """The scrape once it counts two finished jobs (None before)."""
    m = await scrape(w)
    done = sum(v for (name, _), v in m.items() if name == "request_finished_total")
    return m if done >= 2 else None


def val(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


async def get_json(w, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{w.server.port}{path}") as r:
        return r.status, await r.json()


def test_metrics_and_logs_match_a_scripted_workload(services, prefix, llama_path):
    # 16 KV blocks of 16 tokens for up to 8 running jobs of ~50 tokens: preemption is forced
    cfg = worker_config(services, prefix, tuning=dict(max_total_tokens=256, max_batched_tokens=64))
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)
    buf = io.StringIO()
    setup_logging("INFO", json=True, stream=buf)
    n_good, n_cancel = 10, 2

    async def main():
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            # produced before the worker starts, so they are fetched together and run at once: preemption is forced
            good = [await client.submit(f"Job {i} says", job_id=f"ok-{i}", priority=("high", "normal", "low")[i % 3],
                                        params=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
                    for i in range(n_good)]
            w, task = await start_worker(cfg, engine)
            # engine rejects: max_tokens over serving_tuning.max_output_tokens (256)
            too_long = [await client.submit("x", job_id=f"rej-{i}", params=SamplingParams(max_tokens=1000))
                        for i in range(2)]
            producer = AIOKafkaProducer(bootstrap_servers=services[0])
            await producer.start()
            await producer.send_and_wait(keys.job_topic(prefix, "normal"), b'{"job_id": "poison", "prompt": 7}',
                                         key=b"poison")
            await producer.stop()
            long_ids = [await client.submit(f"Long {i}", job_id=f"cancel-{i}",
                                            params=SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
                        for i in range(n_cancel)]
            streams = {j: asyncio.create_task(collect(client, j)) for j in good + too_long + ["poison"] + long_ids}
            for j in long_ids:  # cancel each long job once it has streamed a token
                async for ev in client.stream(j, timeout_s=60):
                    if isinstance(ev, Token):
                        break
                await client.cancel(j)
            results = {j: await t for j, t in streams.items()}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # gauges are refreshed by the engine thread / check loop
            m = await scrape(w)
            if (val(m, "running_requests") == 0 and val(m, "kv_cache_usage_ratio") == 0
                    and val(m, "local_jobs") == 0 and total(m, "kafka_consumer_lag") == 0):
                break
            await asyncio.sleep(0.3)
        await stop_worker(w, task)
        return results, m

    try:
        results, m = asyncio.run(main())
    finally:
        setup_logging("INFO")
    reasons = {j: assert_well_formed(evs, j).finish_reason for j, evs in results.items()}
    assert [reasons[f"ok-{i}"] for i in range(n_good)] == ["length"] * n_good
    assert {reasons[f"cancel-{i}"] for i in range(n_cancel)} == {"cancelled"}
    assert {reasons["rej-0"], reasons["rej-1"], reasons["poison"]} == {"rejected"}
    engine_jobs = [j for j in results if j.startswith(("ok-", "cancel-"))]
    delivered = {j: sum(len(e.token_ids) for e in results[j] if isinstance(e, Token)) for j in results}

    # counters match the scenario exactly
    assert val(m, "request_finished_total", finish_reason="length") == n_good
    assert val(m, "request_finished_total", finish_reason="cancelled") == n_cancel
    assert val(m, "request_finished_total", finish_reason="rejected") == 3
    assert val(m, "request_rejected_total", reason="invalid_params") == 2
    assert val(m, "request_rejected_total", reason="invalid_job") == 1
    assert total(m, "dlq_records_total") == 3  # every record that will never run: 2 engine rejects + the poison one
    assert val(m, "dlq_records_total", reason="invalid_params") == 2  # by reason: client mistakes apart
    assert val(m, "dlq_records_total", reason="invalid_job") == 1
    assert val(m, "request_abort_total", reason="cancelled") == n_cancel
    assert val(m, "cancel_to_free_seconds_count") == n_cancel
    assert val(m, "cancels_received_total") == n_cancel
    # output tokens: exactly what the streams delivered, although jobs were preempted and recomputed
    assert val(m, "preemptions_total") > 0
    assert val(m, "generation_tokens_total") == sum(delivered.values())
    # one latency observation per finished engine job (TPOT needs two tokens)
    assert total(m, "llm_e2e_request_latency_seconds_count") == len(engine_jobs)
    assert total(m, "llm_ttft_seconds_count") == len(engine_jobs)
    assert total(m, "request_queue_time_seconds_count") == len(engine_jobs)
    assert total(m, "llm_tpot_seconds_count") == sum(1 for j in engine_jobs if delivered[j] >= 2)
    assert val(m, "llm_ttft_seconds_count", priority="high") == sum(1 for i in range(n_good) if i % 3 == 0)
    # idle: gauges back to zero, partitions assigned, lag consumed
    assert val(m, "kv_cache_usage_ratio") == 0 and val(m, "running_requests") == 0
    assert val(m, "waiting_requests") == 0 and val(m, "local_jobs") == 0
    assert val(m, "kafka_assigned_partitions") == 9
    assert total(m, "kafka_consumer_lag") == 0
    assert val(m, "kv_cache_blocks") == 16

    # logs: JSON lines, one summary per job with its Kafka coordinates, no line per token
    lines = [json.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
    summaries = [x for x in lines if x["event"] == "job finished"]
    assert sorted(x["job_id"] for x in summaries) == sorted(results)
    for x in summaries:
        assert x["topic"].startswith(prefix) and x["partition"] >= 0 and x["offset"] >= 0
        if x["job_id"].startswith("ok-"):
            assert x["finish_reason"] == "length" and x["tokens"] == 30
            assert x["ttft_s"] > 0 and x["tokens_per_s"] > 0 and x["queue_s"] >= 0 and x["e2e_s"] > 0
    assert len(lines) < 4 * len(results) + 40, "log volume must not grow with tokens"


def test_injected_oom_fails_the_job_and_the_worker_keeps_serving(services, prefix, llama_path):
    cfg = worker_config(services, prefix, tuning=dict(max_oom_retries=0))
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)
    execute = engine.runner.execute
    calls = {"n": 0}

    def failing_execute(sched):  # the 3rd forward of the worker runs out of memory
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return execute(sched)

    engine.runner.execute = failing_execute

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            first = await collect(client, await client.submit("victim", job_id="victim", params=params))
            after = await collect(client, await client.submit("next one", job_id="after", params=params))
        m = await wait_until(lambda: finished_both(w), 10, "both jobs counted as finished")
        await stop_worker(w, task)
        return first, after, m

    first, after, m = asyncio.run(main())
    fin = assert_well_formed(first, "victim")
    assert fin.finish_reason == "error" and fin.error.code == "oom"
    assert assert_well_formed(after, "after").finish_reason == "length"
    assert val(m, "request_oom_total", outcome="failed") == 1
    assert val(m, "request_finished_total", finish_reason="error") == 1
    assert val(m, "kv_cache_usage_ratio") == 0
    assert isinstance(after[-1], Finished) and after[-1].usage.completion_tokens == 8


async def wait_ready(w, want: bool, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status, body = await get_json(w, "/readyz")
        if (status == 200) == want:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"/readyz never became {'ready' if want else 'unready'}: {status} {body}")
        await asyncio.sleep(0.2)


def test_readyz_follows_kafka_redis_and_drain(own_stack, prefix, llama_path):
    # Freezes (SIGSTOP) a broker and a Redis server of its own, never the dev stack that
    # tests running beside it share.
    services = (own_stack.bootstrap, own_stack.redis_url)
    asyncio.run(create_and_see_topics(own_stack.bootstrap, prefix))
    cfg = worker_config(services, prefix, metrics=dict(check_interval_s=0.3, check_timeout_s=1.0),
                        worker=dict(drain_timeout_s=20.0))
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)
    redis_pid, kafka_pid = own_stack.pid("redis"), own_stack.pid("kafka")

    async def freeze(pid: int, what: str) -> tuple[dict, dict]:
        os.kill(pid, signal.SIGSTOP)
        try:
            down = await wait_ready(w, False, timeout=10)
        finally:
            os.kill(pid, signal.SIGCONT)
        up = await wait_ready(w, True, timeout=30)
        return down, up

    async def main():
        nonlocal w
        w, task = await start_worker(cfg, engine)
        status, live = await get_json(w, "/healthz")
        assert status == 200 and live["status"] == "ok"
        ready = await wait_ready(w, True)
        redis_down, _ = await freeze(redis_pid, "redis")
        kafka_down, _ = await freeze(kafka_pid, "kafka")
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            jid = await client.submit("drain me", job_id="drain",
                                      params=SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
            async for ev in client.stream(jid, timeout_s=60):
                if isinstance(ev, Token):
                    break
            w.request_stop()  # drain: the running job may finish, the worker is unready meanwhile
            draining = await wait_ready(w, False, timeout=5)
            status, live = await get_json(w, "/healthz")
            events = await collect(client, jid)
        await finished_within(task, 60, "the draining worker")
        return ready, redis_down, kafka_down, draining, status, events

    w = None
    ready, redis_down, kafka_down, draining, live_status, events = asyncio.run(main())
    assert ready["checks"] == {"model_loaded": True, "kafka": True, "redis": True, "not_draining": True}
    assert redis_down["checks"]["redis"] is False and redis_down["checks"]["kafka"] is True
    assert kafka_down["checks"]["kafka"] is False and "kafka" in kafka_down["errors"]
    assert draining["checks"]["not_draining"] is False
    assert live_status == 200  # draining is not dead
    assert assert_well_formed(events, "drain").finish_reason == "length"


def test_jobs_ended_before_running_echo_metadata(services, prefix, llama_path):
    cfg = worker_config(services, prefix)
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            late = await client.submit("x", job_id="late", deadline=time.time() - 60, metadata={"user": "u1"})
            await client.cancel("early")  # the tombstone is there before the job
            early = await client.submit("x", job_id="early", metadata={"user": "u2"})
            results = [await collect(client, late), await collect(client, early)]
        await stop_worker(w, task)
        return results

    late, early = asyncio.run(main())
    fin = assert_well_formed(late, "late")
    assert fin.finish_reason == "expired" and fin.error.code == "deadline_passed" and fin.metadata == {"user": "u1"}
    fin = assert_well_formed(early, "early")
    assert fin.finish_reason == "cancelled" and fin.metadata == {"user": "u2"}


def test_cli_reports_refusals_and_timeouts_without_tracebacks(services, prefix):
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "worker", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)

    r = cli("topics", "create", "--bootstrap", services[0], "--prefix", f"{prefix}x", "--replication-factor", "3")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "refused" in r.stderr and "replication factor" in r.stderr.lower(), r.stderr
    r = cli("stream", "never-submitted", "--timeout", "1", "--kafka", services[0], "--redis", services[1],
            "--prefix", prefix)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "timeout" in r.stderr, r.stderr
    # the hint names the likely causes (issue 32: a silent wait for ever was the default)
    assert "pass --tenant" in r.stderr and f"{prefix}.dlq" in r.stderr, r.stderr
    r = cli("submit", "--prompt", "x", "--job-id", "a b", "--kafka", services[0], "--redis", services[1],
            "--prefix", prefix)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "job_id" in r.stderr, r.stderr
    # an id nothing knows of is said so within seconds, not only at the timeout (issue 49)
    r = cli("stream", "never-submitted", "--timeout", "9", "--kafka", services[0], "--redis", services[1],
            "--prefix", prefix)
    lines = r.stderr.splitlines()
    notice = [i for i, ln in enumerate(lines) if ln.startswith("[nothing known of job never-submitted yet: no event "
                                                                "log without a tenant, no claim, no results record")]
    timeout = [i for i, ln in enumerate(lines) if "timeout" in ln]
    assert r.returncode == 1 and len(notice) == 1 and timeout and notice[0] < timeout[0], r.stderr


def test_cli_streams_text_alone_on_stdout_and_a_tenant_miss_gets_a_hint(services, prefix, llama_path):
    import sys

    cfg = worker_config(services, prefix)
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)
    conn = ["--kafka", services[0], "--redis", services[1], "--prefix", prefix]

    async def cli(*args):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "worker", *args, cwd=ROOT,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        async with asyncio.timeout(120):
            out, err = await proc.communicate()
        return proc.returncode, out.decode(), err.decode()

    async def main():
        w, task = await start_worker(cfg, engine)
        try:
            streamed = await cli("submit", "--prompt", "Hello", "--job-id", "cli-text", "--tenant", "acme",
                                 "--max-tokens", "5", "--stream", *conn)
            missed = await cli("stream", "cli-text", "--timeout", "2", *conn)  # no --tenant
            # the sampling flags reach the job: past EOS to --max-tokens (issue 49)
            long = await cli("submit", "--prompt", "Hello", "--max-tokens", "40", "--ignore-eos", "--temperature",
                             "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "3", "--stream", *conn)
        finally:
            await stop_worker(w, task)
        return streamed, missed, long

    (code, out, err), (code2, _, err2), (code3, _, err3) = asyncio.run(main())
    assert code3 == 0 and "[finished: length, 40 tokens]" in err3, err3
    assert code == 0, err
    assert "cli-text" not in out and "[job cli-text]" in err  # stdout: the text alone
    assert "[finished: " in err and "[finished" not in out
    assert code2 == 1 and "results topic" in err2 and "pass the --tenant" in err2, err2


def test_cli_help_shows_every_default():
    import subprocess
    import sys

    for cmd, shown in (("submit", ["default: 64", "default: 0.0", "default: normal", "default: 600.0"]),
                       ("stream", ["default: 600.0"]), ("generate", ["default: 64", "default: auto"])):
        r = subprocess.run([sys.executable, "-m", "worker", cmd, "--help"], cwd=ROOT, capture_output=True, text=True)
        help_text = " ".join(r.stdout.split())
        assert r.returncode == 0 and all(x in help_text for x in shown), (cmd, r.stdout)


def test_local_jobs_gauge_follows_the_job_table_at_every_scrape(services, prefix):
    # issue 32: it was set by the health loop (every 5 s by default) and read 0 while jobs ran
    from schemas.wire import Started
    from tests.integration.helpers import slow_null_engine

    cfg = worker_config(services, prefix, metrics=dict(check_interval_s=60.0))
    engine = slow_null_engine(0.01)

    async def main():
        w, task = await start_worker(cfg, engine)
        get = w.metrics.registry.get_sample_value
        seen = []
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            job = await client.submit("x", params=SamplingParams(max_tokens=150, ignore_eos=True))
            async for ev in client.stream(job, timeout_s=60):
                if isinstance(ev, Started):
                    seen.append(get("local_jobs"))
            await asyncio.sleep(0.2)
            seen.append(get("local_jobs"))
        await stop_worker(w, task)
        return seen

    assert asyncio.run(main()) == [1, 0]


def test_metrics_port_in_use_is_a_config_error(services, prefix, llama_path):
    import socket

    from worker.config import ConfigError
    from worker.serve.worker import Worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = worker_config(services, prefix, metrics=dict(port=port))

        async def main():
            w = Worker(cfg, engine=None)
            with pytest.raises(ConfigError, match=f"metrics.port {port}"):
                await w.server.start()

        asyncio.run(main())


def test_engine_rejection_has_no_started_event(services, prefix, llama_path):
    cfg = worker_config(services, prefix)
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            bad = await collect(client, await client.submit("x", job_id="too-long", params=SamplingParams(max_tokens=999)))
            good = await collect(client, await client.submit(
                "y", job_id="fine", params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
        await stop_worker(w, task)
        return bad, good

    bad, good = asyncio.run(main())
    fin = assert_well_formed(bad, "too-long")
    assert len(bad) == 1 and fin.finish_reason == "rejected" and fin.error.code == "invalid_params"
    assert assert_well_formed(good, "fine").finish_reason in ("stop", "length")
    assert type(good[0]).__name__ == "Started" and type(good[1]).__name__ == "Token"
