"""Traces without services (issue 27): a job's span tree built from its lifecycle in the
job table, trace context through Kafka headers, sampling, the engine's trace events,
the client's PRODUCER span, log and exemplar correlation, an unreachable collector, and
that tracing off imports no OpenTelemetry at all. The real back end (Jaeger) is in
tests/integration/test_tracing.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from schemas.params import SamplingParams
from schemas.wire import ChatMessage, ErrorInfo, FinishReason, Job
from worker.client.tracing import ProducerSpans
from worker.config import EngineConfig, ServingTuning, TracingConfig
from worker.engine import RequestOutput, Usage
from worker.engine.inputs import RequestInput
from worker.engine.outputs import RequestTimes, TraceEvent
from worker.model.null_runner import null_engine
from worker.obs.metrics import Metrics, exposition
from worker.obs.otlp_encode import any_value, encode_json
from worker.obs.span_records import record_of
from worker.obs.trace_context import ACTIVE, add_trace_ids, context_from_headers, headers_for
from worker.obs.tracing import OFF, setup_tracing
from worker.serve.claims import Claimed
from worker.serve.jobs import JobTable
from worker.serve.read_ahead import JobRecord

ROOT = Path(__file__).resolve().parents[2]
TP = namedtuple("TP", "topic partition")("inflight.jobs.normal", 3)
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


def tracing(exporter: InMemorySpanExporter, **cfg):
    return setup_tracing(TracingConfig(enabled=True, **cfg), "inflight-worker", instance_id="w1", model="tiny",
                         consumer_group="inflight-workers", exporter=exporter, set_global=False)


def finished(tr, exporter) -> dict[str, list]:
    tr.provider.force_flush()
    by_name: dict[str, list] = {}
    for s in exporter.get_finished_spans():
        by_name.setdefault(s.name, []).append(s)
    return by_name


def record(job: Job, headers=(), read_time: float = 1000.0) -> JobRecord:
    return JobRecord(job, "normal", TP, 42, 999.5, b"raw", job.job_id.encode(), headers=tuple(headers),
                     read_time=read_time)


def run_job(tr, table: JobTable, job: Job, headers=(), attempt: int = 1, times: RequestTimes | None = None):
    """One job through the table as the worker drives it: claimed at 1000.2, tokenized,
    submitted at 1000.3, first token at 1000.6, finished at 1001.0, published, recorded,
    offset done at 1001.2."""
    rec = record(job, headers)
    held = table.open(JobRecord(job, "normal", TP, 42, rec.enqueue_time, b"raw", None), Claimed("tok", attempt, 0, 0, False))
    held.trace = tr.open_job(rec, held, 1000.1, 1000.2)
    if held.trace is None:
        return held
    held.trace.tokenize = (1000.2, 1000.25)
    held.trace.submitted = 1000.3
    table.accepted(job.job_id)
    clock.now = 1000.6
    table.apply_outputs([RequestOutput(job.job_id, [5], "a")])
    clock.now = 1001.0
    times = times or RequestTimes(999.5, 1000.35, 1000.55, 1000.95, [
        TraceEvent("prefill_chunk", 1000.45, 16), TraceEvent("prefill_chunk", 1000.55, 4),
        TraceEvent("preempted", 1000.7, 21, "kv_full")])
    table.apply_outputs([RequestOutput(job.job_id, [6], "b", finished=True, finish_reason="length", num_preemptions=1,
                                       usage=Usage(prompt_tokens=20, completion_tokens=2, cached_prompt_tokens=16),
                                       times=times)])
    table.drain()
    held.trace.published_at = 1001.05
    held.trace.recorded = (1001.1, 1001.15)
    held.trace.end(1001.2)
    return held


class Clock:
    now = 1000.2

    def __call__(self) -> float:
        return self.now


clock = Clock()


@pytest.fixture(autouse=True)
def _reset_clock():
    clock.now = 1000.2
    yield
    ACTIVE.clear()


def test_a_job_gives_one_consumer_span_with_its_phases_as_children():
    exporter = InMemorySpanExporter()
    tr = tracing(exporter)
    table = JobTable("w1", clock=clock)
    job = Job(job_id="j1", prompt="hi", tenant="acme", params=SamplingParams(max_tokens=2, temperature=0.5))
    header = (("traceparent", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01".encode()),)
    run_job(tr, table, job, header)
    spans = finished(tr, exporter)
    assert sorted(spans) == sorted(["process inflight.jobs.normal", "read_ahead", "claim", "tokenize", "engine.queue",
                                    "prefill", "decode", "publish", "results.write"])
    root = spans["process inflight.jobs.normal"][0]
    assert root.kind == SpanKind.CONSUMER
    assert format(root.context.trace_id, "032x") == PARENT_TRACE  # joins the producer's trace
    assert format(root.parent.span_id, "016x") == PARENT_SPAN and root.parent.is_remote
    for name, found in spans.items():
        assert len(found) == 1, name
        if found[0] is not root:
            assert found[0].parent.span_id == root.context.span_id, name
            assert found[0].context.trace_id == root.context.trace_id
    a = root.attributes
    assert a["messaging.system"] == "kafka" and a["messaging.destination.name"] == TP.topic
    assert a["messaging.destination.partition.id"] == "3" and a["messaging.kafka.offset"] == 42
    assert a["messaging.consumer.group.name"] == "inflight-workers" and a["messaging.operation.type"] == "process"
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.request.max_tokens"] == 2 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.usage.input_tokens"] == 20 and a["gen_ai.usage.output_tokens"] == 2
    assert list(a["gen_ai.response.finish_reasons"]) == ["length"] and a["gen_ai.response.id"] == "j1"
    assert a["inflight.job_id"] == "j1" and a["inflight.tenant"] == "acme" and a["inflight.attempt"] == 1
    assert a["inflight.worker_id"] == "w1" and a["inflight.prefix_cache_hit_tokens"] == 16
    assert a["inflight.ttft_s"] == pytest.approx(1000.6 - 999.5, abs=1e-4)  # = the job's own timings
    assert a["inflight.queue_time_s"] == pytest.approx(1000.35 - 999.5, abs=1e-4)
    assert a["inflight.preemptions"] == 1
    assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a  # no content by default

    def window(name):
        s = spans[name][0]
        return round(s.start_time / 1e9, 3), round(s.end_time / 1e9, 3)

    assert window("process inflight.jobs.normal") == (1000.0, 1001.2)
    assert window("read_ahead") == (1000.0, 1000.1) and window("claim") == (1000.1, 1000.2)
    assert window("tokenize") == (1000.2, 1000.25) and window("engine.queue") == (1000.3, 1000.35)
    assert window("prefill") == (1000.35, 1000.55) and window("decode") == (1000.55, 1000.95)
    assert window("publish") == (1001.0, 1001.05) and window("results.write") == (1001.1, 1001.15)
    assert [(e.name, e.attributes["inflight.tokens"]) for e in spans["prefill"][0].events] == [
        ("prefill_chunk", 16), ("prefill_chunk", 4)]
    events = {e.name: e for e in root.events}
    assert events["preempted"].attributes["inflight.reason"] == "kv_full"
    assert round(events["first_token"].timestamp / 1e9, 3) == 1000.6
    assert "offset_done" in events and root.status.status_code == StatusCode.UNSET


def test_every_span_of_a_job_carries_the_producers_tracestate():
    """W3C trace context: a child inherits its parent's trace state. The producer's
    `tracestate` header reaches the CONSUMER span and every phase span under it."""
    exporter = InMemorySpanExporter()
    tr = tracing(exporter)
    job = Job(job_id="j1", prompt="hi", params=SamplingParams(max_tokens=2))
    headers = (("traceparent", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01".encode()),
               ("tracestate", b"vendor=abc,other=x1"))
    run_job(tr, JobTable("w1", clock=clock), job, headers)
    spans = [s for found in finished(tr, exporter).values() for s in found]
    assert len(spans) == 9
    for s in spans:
        assert list(s.context.trace_state.items()) == [("vendor", "abc"), ("other", "x1")], s.name


def test_rejected_cancelled_restarted_and_handed_back_jobs_say_so():
    exporter = InMemorySpanExporter()
    tr = tracing(exporter, capture_content=True)
    table = JobTable("w1", clock=clock)
    # rejected before the engine (DLQ)
    job = Job(job_id="rej", prompt="x" * 10)
    rec = record(job)
    held = table.open(JobRecord(job, "normal", TP, 1, 999.0, b"raw", None), Claimed("tok", 1, 0, 0, False))
    held.trace = tr.open_job(rec, held, 1000.1, 1000.2)
    table.finish_local("rej", FinishReason.REJECTED, ErrorInfo(code="prompt_too_long", message="too long"),
                       dead_letter=("prompt_too_long", "too long"))
    held.trace.end(1000.5)
    # a later attempt, cancelled while it runs
    job2 = Job(job_id="can", messages=[ChatMessage(role="user", content="hi")])
    held2 = table.open(JobRecord(job2, "normal", TP, 2, 999.0, None, None), Claimed("tok", 2, 3, 0, False))
    held2.trace = tr.open_job(record(job2), held2, 1000.1, 1000.2)
    table.accepted("can")
    table.request_cancel("can")
    from opentelemetry import trace

    cancel_span = TracerProvider().get_tracer("t").start_span("send inflight.cancel")
    held2.trace.cancel_requested(headers_for(trace.set_span_in_context(cancel_span)))
    table.apply_outputs([RequestOutput("can", [], "", finished=True, finish_reason="cancelled",
                                       usage=Usage(prompt_tokens=2, completion_tokens=0),
                                       times=RequestTimes(999.0, 1000.3, None, 1000.4))])
    held2.trace.end(1000.5)
    # handed back at drain
    job3 = Job(job_id="back", prompt="hi")
    held3 = table.open(JobRecord(job3, "normal", TP, 3, 999.0, None, None), Claimed("tok", 1, 0, 0, False))
    held3.trace = tr.open_job(record(job3), held3, 1000.1, 1000.2)
    table.accepted("back")
    table.hand_back("back")
    spans = [s for s in finished(tr, exporter)["process inflight.jobs.normal"]]
    by_job = {s.attributes["inflight.job_id"]: s for s in spans}
    rej = by_job["rej"]
    assert rej.status.status_code == StatusCode.ERROR and "prompt_too_long" in rej.status.description
    assert rej.attributes["error.type"] == "prompt_too_long" and rej.attributes["inflight.dead_letter"] == "prompt_too_long"
    assert "rejected" in [e.name for e in rej.events]
    assert rej.attributes["gen_ai.input.messages"] == json.dumps("x" * 10)  # content capture on
    can = by_job["can"]
    names = [e.name for e in can.events]
    assert {"restarted", "cancel_requested", "cancelled"} <= set(names) and can.attributes["inflight.attempt"] == 2
    assert list(can.attributes["gen_ai.response.finish_reasons"]) == ["cancelled"]
    assert can.attributes["gen_ai.operation.name"] == "chat" and can.status.status_code == StatusCode.UNSET
    assert [link.context.span_id for link in can.links] == [cancel_span.get_span_context().span_id]
    back = by_job["back"]
    assert back.attributes["inflight.outcome"] == "handed_back" and "handed_back" in [e.name for e in back.events]
    assert not ACTIVE  # every ended job left the log-correlation registry


def test_trace_context_through_kafka_headers():
    provider = TracerProvider()
    span = provider.get_tracer("t").start_span("producer")
    from opentelemetry import trace

    headers = headers_for(trace.set_span_in_context(span))
    assert [k for k, _ in headers] == ["traceparent"]
    ctx = context_from_headers(headers + [("other", b"x")])
    got = trace.get_current_span(ctx).get_span_context()
    assert got.trace_id == span.get_span_context().trace_id and got.span_id == span.get_span_context().span_id
    assert context_from_headers(()) is None and context_from_headers(None) is None
    assert context_from_headers([("traceparent", b"00-not-a-trace-01")]) is None  # a new trace, no error
    assert context_from_headers([("traceparent", b"\xff\xfe")]) is None
    assert context_from_headers([("TraceParent", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01".encode())]) is not None
    http = context_from_headers([("traceparent", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01")])  # HTTP headers: text
    assert format(trace.get_current_span(http).get_span_context().trace_id, "032x") == PARENT_TRACE
    assert headers_for() == []  # no current span: nothing to carry


def test_sampling_ratio_and_parent_based_decisions():
    exporter = InMemorySpanExporter()
    tr = tracing(exporter, sample_ratio=0.1)
    table = JobTable("w1", clock=clock)
    traced = sum(run_job(tr, table, Job(job_id=f"s{i}", prompt="hi")).trace is not None for i in range(500))
    assert 25 <= traced <= 80, traced  # ~10% of 500 (binomial sd ~6.7)
    roots = finished(tr, exporter)["process inflight.jobs.normal"]
    assert len(roots) == traced
    never = tracing(InMemorySpanExporter(), sample_ratio=0.0)
    sampled_parent = (("traceparent", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01".encode()),)
    unsampled_parent = (("traceparent", f"00-{PARENT_TRACE}-{PARENT_SPAN}-00".encode()),)
    assert run_job(never, table, Job(job_id="p1", prompt="hi"), sampled_parent).trace is not None
    assert run_job(never, table, Job(job_id="p2", prompt="hi")).trace is None
    always = tracing(InMemorySpanExporter(), sample_ratio=1.0)
    assert run_job(always, table, Job(job_id="p3", prompt="hi"), unsampled_parent).trace is None


def test_the_engine_records_chunks_and_preemptions_of_traced_requests_only():
    eng = null_engine(EngineConfig(serving_tuning=ServingTuning(
        kv_block_size=16, max_total_tokens=6 * 16, enable_prefix_caching=False, max_batched_tokens=32,
        max_output_tokens=64)), vocab_size=100, max_model_len=2048)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for rid, traced in (("a", True), ("b", False), ("c", True)):
        eng.submit(eng.input.process(RequestInput.of(rid, prompt_token_ids=list(range(1, 41)), params=params,
                                                     traced=traced)))
    times = {}
    for _ in range(2000):
        for o in eng.step():
            if o.finished:
                times[o.request_id] = o.times
        if not eng.has_unfinished():
            break
    assert times["b"].events is None
    assert times["a"].events and times["c"].events
    events = times["a"].events + times["c"].events
    chunks = [e for e in events if e.name == "prefill_chunk"]
    assert chunks and all(0 < e.tokens <= 32 for e in chunks)
    preempted = [e for e in events if e.name == "preempted"]
    assert preempted and all(e.reason in ("kv_full", "admission") for e in preempted)  # 3 x 80 tokens in 96 slots
    for rid in ("a", "c"):
        ev = times[rid].events
        first = [e for e in ev if e.name == "prefill_chunk"]
        assert sum(e.tokens for e in first if e.time <= times[rid].first_token_time) >= 40  # whole prompt by TTFT
        assert all(times[rid].first_scheduled_time <= e.time <= times[rid].finished_time for e in ev)


def test_producer_span_carries_its_context_in_the_record_headers(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sent = []
    Meta = namedtuple("Meta", "partition offset")

    async def send(topic, value, key, headers):
        sent.append(headers)
        return Meta(2, 17)

    import asyncio

    asyncio.run(ProducerSpans(None, provider).send(send, "inflight.jobs.high", b"v", b"j9", {"inflight.job_id": "j9"}))
    (span,) = exporter.get_finished_spans()
    assert span.name == "send inflight.jobs.high" and span.kind == SpanKind.PRODUCER
    assert span.attributes["messaging.destination.partition.id"] == "2" and span.attributes["messaging.kafka.offset"] == 17
    assert span.attributes["messaging.kafka.message.key"] == "j9" and span.attributes["inflight.job_id"] == "j9"
    (name, value), = sent[0]
    assert name == "traceparent" and value.decode().split("-")[1:3] == [
        format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")]
    # the default mode in a process whose application set up no SDK (an earlier test in
    # this process may have installed a global provider): no span, no headers
    from opentelemetry import trace

    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
    asyncio.run(ProducerSpans(None).send(send, "t", b"v", b"k", {}))
    asyncio.run(ProducerSpans(False, provider).send(send, "t", b"v", b"k", {}))
    assert sent[1:] == [None, None] and len(exporter.get_finished_spans()) == 1


def test_log_lines_and_exemplars_carry_the_trace_of_their_job():
    exporter = InMemorySpanExporter()
    tr = tracing(exporter)
    table = JobTable("w1", clock=clock)
    job = Job(job_id="logged", prompt="hi")
    held = table.open(JobRecord(job, "normal", TP, 1, 999.0, None, None), Claimed("tok", 1, 0, 0, False))
    held.trace = tr.open_job(record(job), held, 1000.1, 1000.2)
    line = add_trace_ids(None, "info", {"event": "job finished", "job_id": "logged"})
    assert line["trace_id"] == held.trace.trace_id and line["span_id"] == held.trace.span_id
    assert "trace_id" not in add_trace_ids(None, "info", {"event": "x", "job_id": "other"})
    m = Metrics()
    m.ttft.labels("normal").observe(0.25, held.trace.exemplar)
    body, ctype = exposition(m.registry, "application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text")
    assert f'trace_id="{held.trace.trace_id}"' in body.decode()
    plain, ctype = exposition(m.registry, "text/plain")
    assert ctype.startswith("text/plain") and b"trace_id" not in plain


def test_an_unreachable_collector_drops_spans_with_one_warning(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    cfg = TracingConfig(enabled=True, endpoint="http://127.0.0.1:9")  # discard port: refused
    with structlog.testing.capture_logs() as logs:
        tr = setup_tracing(cfg, "inflight-worker", set_global=False)
        table = JobTable("w1", clock=clock)
        t0 = time.monotonic()
        for i in range(300):
            run_job(tr, table, Job(job_id=f"u{i}", prompt="hi"))
        spent = time.monotonic() - t0
        deadline = time.monotonic() + 20
        while tr.exporter.num_dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        t1 = time.monotonic()
        tr.shutdown(timeout_s=2.0)
        shutdown_s = time.monotonic() - t1
    assert tr.exporter.num_dropped > 0 and tr.exporter.num_exported == 0
    warnings = [x for x in logs if x["log_level"] == "warning"]
    assert len(warnings) == 1 and "trace export failed" in warnings[0]["event"], warnings
    assert spent < 10, spent  # the jobs never waited on the exporter (a blocked export would take 300 s)
    assert shutdown_s < 5, shutdown_s  # bounded at shutdown too


def test_tracing_off_imports_no_opentelemetry_on_the_job_path():
    """With every `opentelemetry` import refused, a worker's whole job path (tracing setup,
    job table lifecycle, engine steps, log lines, the client's send) runs, and nothing on
    it tries to import OpenTelemetry. (redis-py probes for it once at import time.)"""
    code = textwrap.dedent('''
        import sys, importlib.abc
        tried = []
        class Refuse(importlib.abc.MetaPathFinder):
            phase = "import"
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] == "opentelemetry":
                    tried.append((self.phase, name))
                    raise ImportError(name)
        finder = Refuse()
        sys.meta_path.insert(0, finder)
        import asyncio, io, structlog
        from schemas.params import SamplingParams
        from schemas.wire import Job
        from worker.client.tracing import ProducerSpans
        from worker.config import EngineConfig, TracingConfig, WorkerConfig
        from worker.engine import RequestOutput, Usage
        from worker.model.null_runner import null_engine
        from worker.obs.log import setup_logging
        from worker.obs.tracing import setup_tracing
        from worker.serve.claims import Claimed
        from worker.serve.jobs import JobTable
        from worker.serve.read_ahead import JobRecord
        import worker.serve.worker, worker.gateway.app, worker.serve.starter, worker.serve.finalize
        finder.phase = "run"
        setup_logging("INFO", json=True, stream=io.StringIO())
        tr = setup_tracing(WorkerConfig().tracing, "inflight-worker")
        assert not tr.enabled and tr.open_job(None, None, 0, 0) is None
        eng = null_engine(EngineConfig(), vocab_size=50, max_model_len=256)
        eng.add_request("r", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4, ignore_eos=True))
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        assert outs[-1].finished and outs[-1].times.events is None
        t = JobTable("w")
        t.open(JobRecord(Job(job_id="r", prompt="hi"), "normal", "tp", 1, 1.0, None, None), Claimed("tok", 1, 0, 0, False))
        t.accepted("r")
        t.apply_outputs(outs)
        held = t.drain().finished[0]
        t.done(held)
        structlog.get_logger("x").info("job finished", job_id="r")
        async def send(topic, value, key, headers):
            assert headers is None
        asyncio.run(ProducerSpans(None).send(send, "t", b"v", b"k", {}))
        print("TRIED", [n for p, n in tried if p == "run"])
    ''')
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TRIED []" in out.stdout, out.stdout[-2000:]


def test_off_is_the_default_and_config_errors_name_the_field():
    assert setup_tracing(TracingConfig(), "x") is OFF
    from worker.config import ConfigError

    with pytest.raises(ConfigError, match="tracing.protocol must be one of"):
        TracingConfig(protocol="udp")
    with pytest.raises(ConfigError, match="tracing.sample_ratio"):
        TracingConfig(sample_ratio=1.5)
    with pytest.raises(ConfigError, match="tracing.endpoint"):
        TracingConfig(endpoint="collector:4318")


def test_an_unknown_otlp_protocol_in_the_environment_is_refused(monkeypatch):
    from worker.config import ConfigError

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/jsn")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_.*PROTOCOL must be one of"):
        setup_tracing(TracingConfig(enabled=True), "x", set_global=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    tr = setup_tracing(TracingConfig(enabled=True, endpoint="http://127.0.0.1:9"), "x", set_global=False)
    assert tr.exporter.where == "http://127.0.0.1:9/v1/traces"
    tr.shutdown(timeout_s=1)


def test_the_otlp_json_encoding_follows_the_proto3_json_mapping():
    exporter = InMemorySpanExporter()
    tr = tracing(exporter)
    table = JobTable("w1", clock=clock)
    header = (("traceparent", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01".encode()),)
    job = Job(job_id="json1", prompt="hi")
    rec = record(job, header)
    held = table.open(JobRecord(job, "normal", TP, 42, rec.enqueue_time, b"raw", None), Claimed("tok", 1, 0, 0, False))
    held.trace = tr.open_job(rec, held, 1000.1, 1000.2)
    table.finish_local("json1", FinishReason.REJECTED, ErrorInfo(code="prompt_too_long", message="long"),
                       dead_letter=("prompt_too_long", "long"))
    held.trace.end(1000.5)
    spans = finished(tr, exporter)
    chosen = [*spans["process inflight.jobs.normal"], *spans["claim"]]
    body = json.loads(encode_json([record_of(s) for s in chosen], dict(chosen[0].resource.attributes)))
    (rs,) = body["resourceSpans"]
    assert {"key": "service.name", "value": {"stringValue": "inflight-worker"}} in rs["resource"]["attributes"]
    (ss,) = rs["scopeSpans"]
    assert ss["scope"]["name"] == "inflight"
    root, claim = ss["spans"]
    assert root["traceId"] == PARENT_TRACE and root["parentSpanId"] == PARENT_SPAN and len(root["spanId"]) == 16
    assert root["kind"] == 5 and claim["kind"] == 1  # CONSUMER, INTERNAL in OTLP's numbering
    assert claim["parentSpanId"] == root["spanId"]
    assert root["startTimeUnixNano"] == str(1000 * 10**9) and root["endTimeUnixNano"] == str(int(1000.5e9))
    attrs = {a["key"]: a["value"] for a in root["attributes"]}
    assert attrs["messaging.kafka.offset"] == {"intValue": "42"}
    assert attrs["gen_ai.response.finish_reasons"] == {"arrayValue": {"values": [{"stringValue": "rejected"}]}}
    assert root["status"]["code"] == 2 and "prompt_too_long" in root["status"]["message"]
    assert [e["name"] for e in root["events"]] == ["rejected", "offset_done"]
    assert {a["key"] for a in root["events"][0]["attributes"]} == {"inflight.error_code", "inflight.error_message"}
    assert any_value(True) == {"boolValue": True} and any_value(0.5) == {"doubleValue": 0.5}
