"""Traces through the real back end (issue 27): a worker, a gateway and a producer export
OTLP to the Jaeger of tools/stack/jaeger.sh, and each job's trace is read back through
Jaeger's query API: a chat request through the gateway (official `openai` client), a job
from `InflightClient` inside the test's own span, jobs produced by `kcat` with and
without a hand-written `traceparent`, preempted, cancelled and rejected jobs, and a job
whose worker is killed with SIGKILL (its trace holds both attempts). The three OTLP
encodings are all used: the gateway and the producers send http/protobuf, the first
worker http/json, the killed worker gRPC."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import structlog
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from schemas import keys
from schemas.params import SamplingParams
from schemas.wire import Finished, Restarted, Token
from tests.integration import jaeger
from tests.integration.conftest import worker_config
from tests.integration.gateway_helpers import client, gateway_config, running_gateway
from tests.integration.helpers import assert_well_formed, collect, running_worker, wait_group_members
from tests.integration.processes import spawn_worker, wait_for_starts, wait_started
from worker.client import InflightClient
from worker.config import TracingConfig

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
CONSUMER = "process {}.jobs.normal"
# Kafka timestamps are whole milliseconds and job timings are rounded: how far a record's
# timestamp, read back from a job's timings, may sit outside the span that stamped it
STAMP_S = 0.002


@pytest.fixture(scope="module")
def jaeger_up():
    if not jaeger_port_open():
        subprocess.run([str(ROOT / "tools" / "stack" / "jaeger.sh"), "up"], check=True, cwd=ROOT)


def jaeger_port_open() -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", int(jaeger.QUERY.rsplit(":", 1)[1]))) == 0


@pytest.fixture
def fast_export(monkeypatch):
    """Spans leave each process within 100 ms (the SDK's default batch delay is 5 s)."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)


def producer_provider(service: str) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{jaeger.OTLP_HTTP}/v1/traces")))
    return provider


def tracing_cfg(service: str, protocol: str = "http/protobuf") -> dict:
    endpoint = jaeger.OTLP_GRPC if protocol == "grpc" else jaeger.OTLP_HTTP
    return {"enabled": True, "endpoint": endpoint, "service_name": service, "protocol": protocol}


def kcat(bootstrap: str, topic: str, key: str, value: bytes, headers: dict[str, str]) -> None:
    cmd = ["kcat", "-P", "-b", bootstrap, "-t", topic, "-k", key]
    for k, v in headers.items():
        cmd += ["-H", f"{k}={v}"]
    subprocess.run(cmd, input=value, check=True, timeout=30)


def check_job_tree(spans, consumer, worker_svc: str) -> None:
    """The worker's phase spans are children of the job's CONSUMER span, in order."""
    kids = {s.name: s for s in spans if s.parent == consumer.span_id}
    for name in ("read_ahead", "claim", "tokenize", "engine.queue", "prefill", "decode", "publish", "results.write"):
        assert name in kids, (name, sorted(kids))
        assert kids[name].service == worker_svc
        assert consumer.start_s - 1e-3 <= kids[name].start_s <= kids[name].end_s <= consumer.end_s + 1e-3, name
    order = ["read_ahead", "claim", "engine.queue", "prefill", "decode", "publish", "results.write"]
    starts = [kids[n].start_s for n in order]
    assert starts == sorted(starts), list(zip(order, starts))
    assert kids["prefill"].end_s <= kids["decode"].start_s + 1e-3


def test_one_trace_per_job_from_the_request_or_producer_to_the_last_token(services, prefix, llama_path, tmp_path,
                                                                          jaeger_up, fast_export):
    wsvc, gsvc, psvc = f"worker-{prefix}", f"gateway-{prefix}", f"producer-{prefix}"
    cfg = worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu"},
                        tuning={"max_running_requests": 8, "max_total_tokens": 256, "max_output_tokens": 256},
                        tracing=tracing_cfg(wsvc, "http/json"))
    gcfg = msgspec.structs.replace(gateway_config(services, prefix, tmp_path / "files", tokenizer=llama_path),
                                   tracing=TracingConfig(**tracing_cfg(gsvc)))
    provider = producer_provider(psvc)
    topic = keys.job_topic(prefix, "normal")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        async with running_worker(cfg), running_gateway(gcfg) as gw, InflightClient(
                services[0], services[1], topic_prefix=prefix, key_prefix=prefix, tracer_provider=provider) as c:
            # 1. a chat request through the gateway
            raw = await client(gw).chat.completions.with_raw_response.create(
                model="tiny-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0)
            chat_job = raw.headers["x-request-id"]
            assert raw.parse().choices[0].message.content is not None
            # a caller that traces: its traceparent makes the gateway's span its child
            http_trace, http_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
            raw = await client(gw).chat.completions.with_raw_response.create(
                model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                extra_headers={"traceparent": f"00-{http_trace}-{http_span}-01"})
            assert raw.parse().choices[0].message.content is not None
            # 2. a job from InflightClient inside the test's own span
            with provider.get_tracer("test").start_as_current_span("test request") as parent:
                own_job = await c.submit("a traced producer", params=greedy)
            own_trace = format(parent.get_span_context().trace_id, "032x")
            # 3. kcat: a hand-written traceparent, and none
            hand_trace, hand_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
            job = {"job_id": "kcat-traced", "prompt": "from kcat", "params": {"max_tokens": 4, "temperature": 0}}
            kcat(services[0], topic, "kcat-traced", json.dumps(job).encode(),
                 {"traceparent": f"00-{hand_trace}-{hand_span}-01"})
            job["job_id"] = "kcat-plain"
            kcat(services[0], topic, "kcat-plain", json.dumps(job).encode(), {})
            # 4. preemptions (4 x 128 tokens in a 256-token KV cache), a cancel, a rejection
            long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
            pre = [await c.submit(prompt_token_ids=list(range(5, 53)), params=long, job_id=f"pre-{i}")
                   for i in range(4)]
            cancel_job = await c.submit("cancel me", params=SamplingParams(max_tokens=240, ignore_eos=True))
            async for ev in c.stream(cancel_job, timeout_s=120):
                if isinstance(ev, Token):
                    break
            with provider.get_tracer("test").start_as_current_span("user cancels"):
                await c.cancel(cancel_job)
            rejected = await c.submit(prompt_token_ids=[7] * 300, params=greedy)
            finals = {j: await c.result(j, timeout_s=180) for j in
                      [own_job, "kcat-traced", "kcat-plain", *pre, cancel_job, rejected]}
            chat_final = await c.result(chat_job, timeout_s=60, tenant="acme")
            return (chat_job, chat_final, own_job, own_trace, hand_trace, hand_span, pre, cancel_job, rejected, finals,
                    http_trace, http_span)

    (chat_job, chat_final, own_job, own_trace, hand_trace, hand_span, pre, cancel_job, rejected, finals,
     http_trace, http_span) = asyncio.run(main())
    provider.shutdown()
    consumer_name = CONSUMER.format(prefix)
    send = f"send {prefix}.jobs.normal"

    async def read():
        # the gateway request: one trace, SERVER -> PRODUCER -> CONSUMER -> phases
        (chat_trace,) = await jaeger.find(gsvc, {"inflight.job_id": chat_job})
        spans = await jaeger.trace(chat_trace, jaeger.having("results.write", "engine.queue", consumer_name,
                                                                "POST /v1/chat/completions", send))
        server = jaeger.by_name(spans, "POST /v1/chat/completions", gsvc)[0]
        produce = jaeger.by_name(spans, f"send {prefix}.jobs.normal", gsvc)[0]
        consumer = jaeger.by_name(spans, consumer_name, wsvc)[0]
        assert server.parent is None and produce.parent == server.span_id and consumer.parent == produce.span_id
        assert server.tags["http.response.status_code"] == 200 and server.tags["inflight.job_id"] == chat_job
        assert consumer.tags["gen_ai.operation.name"] == "chat" and consumer.tags["gen_ai.response.id"] == chat_job
        assert consumer.tags["gen_ai.usage.output_tokens"] == 6 and "length" in consumer.tags[
            "gen_ai.response.finish_reasons"]
        assert consumer.tags["gen_ai.request.max_tokens"] == 6 and consumer.tags["inflight.tenant"] == "acme"
        check_job_tree(spans, consumer, wsvc)
        t = chat_final.timings  # the job's own timings, measured from the record's Kafka timestamp
        assert consumer.tags["inflight.ttft_s"] == pytest.approx(t.ttft_s, abs=1e-4)
        assert consumer.tags["inflight.queue_time_s"] == pytest.approx(t.queue_s, abs=1e-4)
        # span clock vs record time: the job's TTFT and queue time count from the record's Kafka
        # timestamp, which the producer stamps inside the gateway's send span; so the first-token
        # event less the TTFT (and the queue's end less the queue time) falls inside that span, however
        # long a loaded box makes the send (a fixed 20 ms bound from the span's start failed at 28 ms)
        first_token = consumer.event("first_token")[1]
        queue_end = next(s for s in spans if s.name == "engine.queue").end_s
        for stamped in (first_token - t.ttft_s, queue_end - t.queue_s):
            assert produce.start_s - STAMP_S <= stamped <= produce.end_s + STAMP_S, (produce, stamped)

        spans = await jaeger.trace(http_trace, jaeger.having("results.write", consumer_name, "POST /v1/chat/completions"))
        server = jaeger.by_name(spans, "POST /v1/chat/completions", gsvc)[0]
        assert server.parent == http_span and jaeger.by_name(spans, consumer_name, wsvc)

        # InflightClient in the test's span: one trace, test span -> PRODUCER -> CONSUMER
        spans = await jaeger.trace(own_trace, jaeger.having("results.write", consumer_name, "test request", send))
        test_span = jaeger.by_name(spans, "test request", psvc)[0]
        produce = jaeger.by_name(spans, f"send {prefix}.jobs.normal", psvc)[0]
        consumer = jaeger.by_name(spans, consumer_name, wsvc)[0]
        assert produce.parent == test_span.span_id and consumer.parent == produce.span_id
        assert produce.tags["messaging.destination.name"] == f"{prefix}.jobs.normal"
        assert produce.tags["messaging.kafka.message.key"] == own_job and "messaging.kafka.offset" in produce.tags
        assert consumer.tags["gen_ai.operation.name"] == "text_completion" and consumer.tags["inflight.attempt"] == 1
        check_job_tree(spans, consumer, wsvc)

        # kcat with a hand-written traceparent joins that trace; without one, its own trace
        spans = await jaeger.trace(hand_trace, jaeger.having("results.write", consumer_name))
        consumer = jaeger.by_name(spans, consumer_name, wsvc)[0]
        assert consumer.parent == hand_span and consumer.tags["inflight.job_id"] == "kcat-traced"
        (plain,) = await jaeger.find(wsvc, {"inflight.job_id": "kcat-plain"})
        spans = await jaeger.trace(plain, jaeger.having("results.write", consumer_name))
        consumer = jaeger.by_name(spans, consumer_name, wsvc)[0]
        assert consumer.parent is None and plain not in (hand_trace, own_trace)

        # preempted jobs say so (and why)
        preempted = 0
        for j in pre:
            assert finals[j].finish_reason == "length"
            (tid,) = await jaeger.find(wsvc, {"inflight.job_id": j})
            spans = await jaeger.trace(tid, jaeger.having("results.write", consumer_name))
            ev = jaeger.by_name(spans, consumer_name)[0].event("preempted")
            if ev is not None:
                preempted += 1
                assert ev[2]["inflight.reason"] in ("kv_full", "admission")
        assert preempted >= 1, [finals[j].usage for j in pre]

        # cancelled: the event, the finish reason, and a link to the cancel's own span
        (tid,) = await jaeger.find(wsvc, {"inflight.job_id": cancel_job})
        spans = await jaeger.trace(tid, jaeger.having("results.write", consumer_name))
        consumer = jaeger.by_name(spans, consumer_name)[0]
        assert finals[cancel_job].finish_reason == "cancelled"
        assert consumer.event("cancel_requested") and consumer.event("cancelled")
        assert "cancelled" in consumer.tags["gen_ai.response.finish_reasons"] and consumer.links

        # rejected: an error status, the reason, the DLQ
        (tid,) = await jaeger.find(wsvc, {"inflight.job_id": rejected})
        spans = await jaeger.trace(tid, jaeger.having("results.write", consumer_name))
        consumer = jaeger.by_name(spans, consumer_name)[0]
        code = finals[rejected].error.code  # a 300-token prompt in a 256-token KV cache
        assert finals[rejected].finish_reason == "rejected" and code == "exceeds_kv_capacity"
        assert consumer.tags["otel.status_code"] == "ERROR" and consumer.tags["error.type"] == code
        assert consumer.tags["inflight.dead_letter"] == code and consumer.event("rejected")

    asyncio.run(read())


def test_a_job_restarted_after_kill_9_shows_both_attempts(services, prefix, llama_path, tmp_path, jaeger_up,
                                                          fast_export):
    wsvc = f"worker-{prefix}"
    cfg = worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu"},
                        tuning={"max_output_tokens": 1000}, tracing=tracing_cfg(wsvc, "grpc"))
    provider = producer_provider(f"producer-{prefix}")
    a, a_log = spawn_worker(tmp_path, cfg, "worker-a")
    try:
        async def main():
            await wait_started(a_log, a)
            await wait_group_members(services[0], cfg.kafka.group_id, 1)
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix,
                                      tracer_provider=provider) as c:
                with provider.get_tracer("test").start_as_current_span("submit") as parent:
                    job = await c.submit("survive a crash", params=SamplingParams(temperature=0, max_tokens=1000,
                                                                                  ignore_eos=True))  # ~3 s
                await wait_for_starts(c, [job], "worker-a", 1)
                await asyncio.sleep(0.3)  # attempt 1's claim span is exported (100 ms batches)
                a.send_signal(signal.SIGKILL)
                a.wait()
                b_cfg = msgspec.structs.replace(cfg, worker=msgspec.structs.replace(cfg.worker, engine_process=False))
                async with running_worker(b_cfg):  # the engine in a thread: a quicker start
                    events = await collect(c, job, 120)
            return job, format(parent.get_span_context().trace_id, "032x"), events

        job, trace_id, events = asyncio.run(main())
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    provider.shutdown()
    fin = assert_well_formed(events, job)
    assert isinstance(fin, Finished) and fin.attempt == 2 and any(isinstance(e, Restarted) for e in events)

    async def read():
        spans = await jaeger.trace(trace_id, lambda s: jaeger.having("results.write", f"send {prefix}.jobs.normal",
                                                                     CONSUMER.format(prefix))(s)
                                   and jaeger.having("claim", count=2)(s))
        claims = sorted((s.tags["inflight.attempt"], s.service) for s in jaeger.by_name(spans, "claim", wsvc))
        assert [a for a, _ in claims] == [1, 2], claims
        consumers = jaeger.by_name(spans, CONSUMER.format(prefix), wsvc)
        assert [c.tags["inflight.attempt"] for c in consumers] == [2]  # attempt 1 died with its worker
        assert consumers[0].event("restarted") and consumers[0].tags["inflight.finish_reason"] == "length"
        produce = jaeger.by_name(spans, f"send {prefix}.jobs.normal")[0]
        assert consumers[0].parent == produce.span_id  # both attempts hang below the one record's producer
        claim1, claim2 = sorted(jaeger.by_name(spans, "claim", wsvc), key=lambda s: s.tags["inflight.attempt"])
        assert claim2.parent == consumers[0].span_id
        assert claim1.parent not in {s.span_id for s in spans} and claim1.start_s < claim2.start_s

    asyncio.run(read())


def test_tracing_on_with_an_unreachable_collector_leaves_jobs_unaffected(services, prefix, llama_path,
                                                                         fast_export, monkeypatch):
    """Spans go to a closed port over gRPC: jobs finish as usual, one warning is logged,
    and the worker stops within its bounds (the final flush is abandoned)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")  # each failed export gives up after 2 s
    cfg = worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu"},
                        worker={"engine_process": False},
                        tracing={"enabled": True, "endpoint": "http://127.0.0.1:9", "protocol": "grpc"})

    async def main():
        async with running_worker(cfg) as w, InflightClient(services[0], services[1], topic_prefix=prefix,
                                                             key_prefix=prefix) as c:
            ids = [await c.submit(f"no collector {i}", params=SamplingParams(max_tokens=8)) for i in range(6)]
            finals = [await c.result(j, timeout_s=120) for j in ids]
            deadline = time.monotonic() + 20
            while not w.tracing.exporter.num_dropped and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return finals, w

    with structlog.testing.capture_logs() as logs:
        t0 = time.monotonic()
        finals, w = asyncio.run(main())
        spent = time.monotonic() - t0
    assert all(f.finish_reason in ("length", "stop") for f in finals)
    assert w.tracing.exporter.num_dropped > 0 and w.tracing.exporter.num_exported == 0
    warned = [x["event"] for x in logs if x["log_level"] == "warning" and "trace" in x["event"]]
    assert warned == ["trace export failed: spans are dropped until the collector answers; jobs are unaffected"]
    assert spent < 60, spent
