"""The trace export process (`worker.obs.trace_export`, issue 50 item 3): spans built on
the worker's event loop reach the collector through a child process exactly as the
in-process exporter sends them; the child survives a group signal, is started again
when it dies, and a full queue drops (counted, one warning) instead of blocking. The
collector here is a local HTTP server taking OTLP/JSON."""

from __future__ import annotations

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
import structlog
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, StatusCode

from schemas.params import SamplingParams
from schemas.wire import ErrorInfo, FinishReason, Job
from tests.unit.test_tracing import PARENT_SPAN, PARENT_TRACE, TP, clock, record, run_job
from worker.config import TracingConfig
from worker.obs import trace_export
from worker.obs.otlp_encode import encode_proto, span_json
from worker.obs.span_records import SpanBuilder, SpanRecord, record_of
from worker.obs.trace_context import ACTIVE, context_from_headers
from worker.obs.tracing import setup_tracing
from worker.serve.claims import Claimed
from worker.serve.jobs import JobTable
from worker.serve.read_ahead import JobRecord


class Collector:
    """An OTLP/HTTP JSON endpoint in a thread: keeps every span it is sent."""

    def __init__(self) -> None:
        spans = self.spans = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                for rs in body["resourceSpans"]:
                    for ss in rs["scopeSpans"]:
                        spans.extend(ss["spans"])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    yield
    ACTIVE.clear()


def process_tracing(endpoint: str, **cfg):
    return setup_tracing(TracingConfig(enabled=True, endpoint=endpoint, protocol="http/json", **cfg),
                         "inflight-worker", instance_id="w1", model="tiny", consumer_group="inflight-workers",
                         set_global=False)


def normalized(spans: list[dict]) -> list[dict]:
    """OTLP/JSON spans with span ids replaced by span names (ids are random per run), and
    the times of events stamped with the wall clock (a cancel's) as "now"."""
    names = {s["spanId"]: s["name"] for s in spans}
    out = []
    for s in spans:
        s = dict(s)
        s["spanId"] = s["name"]
        s["parentSpanId"] = names.get(s.get("parentSpanId"), s.get("parentSpanId"))
        s["events"] = [{**e, "timeUnixNano": "now" if int(e["timeUnixNano"]) > 10**15 else e["timeUnixNano"]}
                       for e in s.get("events", ())]
        out.append(s)
    return sorted(out, key=lambda s: s["name"])


def jobs_both_ways(tr, table):
    """Two jobs that use every record field: a producer's context with a trace state,
    events with attributes, a cancel's link, a rejection's error status, a later
    attempt, captured content."""
    headers = (("traceparent", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01".encode()), ("tracestate", b"vendor=abc"))
    run_job(tr, table, Job(job_id="ok", prompt="hi", params=SamplingParams(max_tokens=2)), headers)
    job = Job(job_id="rej", prompt="x" * 10)
    held = table.open(JobRecord(job, "normal", TP, 1, 999.0, b"raw", None), Claimed("tok", 2, 0, 0, False))
    held.trace = tr.open_job(record(job, headers), held, 1000.1, 1000.2)
    held.trace.cancel_requested((("traceparent", f"00-{'ab' * 16}-{'cd' * 8}-01".encode()),
                                 ("tracestate", b"k=v")))
    table.finish_local("rej", FinishReason.REJECTED, ErrorInfo(code="prompt_too_long", message="too long"),
                       dead_letter=("prompt_too_long", "too long"))
    held.trace.end(1000.5)


def test_the_export_process_sends_what_the_in_process_exporter_sends(collector):
    """The same jobs traced twice, exported in-process (the SDK's batch processor) and
    through the export process: the spans the collector gets are the same, field by
    field (ids aside), in OTLP/JSON."""
    memory = InMemorySpanExporter()
    local = setup_tracing(TracingConfig(enabled=True, capture_content=True), "inflight-worker", instance_id="w1",
                          model="tiny", consumer_group="inflight-workers", exporter=memory, set_global=False)
    jobs_both_ways(local, JobTable("w1", clock=clock))
    local.provider.force_flush()
    expected = normalized([span_json(record_of(s)) for s in memory.get_finished_spans()])
    clock.now = 1000.2
    remote = process_tracing(collector.endpoint, capture_content=True)
    assert remote.export == "process"
    jobs_both_ways(remote, JobTable("w1", clock=clock))
    assert remote.sink.force_flush(30)
    got = normalized(collector.spans)
    remote.shutdown(timeout_s=5)
    assert len(got) == len(expected) == 12
    assert got == expected
    consumer = [s for s in got if s["name"].startswith("process") and s.get("links")][0]
    assert consumer["links"][0]["traceId"] == "ab" * 16 and consumer["status"]["code"] == 2
    assert all(s["traceState"] == "vendor=abc" for s in got)
    assert remote.exporter.num_exported == 12 and remote.exporter.num_dropped == 0


def test_a_live_sdk_span_survives_the_record_round_trip():
    """The gateway's and the client's spans are ordinary SDK spans: as records through
    msgpack and back they encode as they did (kind, parent, attributes with sequences,
    events, links, error status, scope)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "g"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    parent = context_from_headers([("traceparent", f"00-{PARENT_TRACE}-{PARENT_SPAN}-01")])
    from opentelemetry import trace

    link = Link(trace.get_current_span(parent).get_span_context(), {"why": "x"})
    span = provider.get_tracer("inflight.gateway").start_span("POST /v1/completions", context=parent,
                                                              kind=SpanKind.SERVER, links=[link])
    span.set_attribute("tags", ["a", "b"])
    span.set_attribute("n", 3)
    span.add_event("e", {"k": 1.5})
    span.set_status(trace.Status(StatusCode.ERROR, "boom"))
    span.end()
    original = memory.get_finished_spans()[0]
    wire = msgspec.msgpack.encode([record_of(original)])
    back = SpanBuilder(original.resource).span(msgspec.msgpack.decode(wire, type=list[SpanRecord])[0])
    assert span_json(record_of(back)) == span_json(record_of(original))
    assert back.attributes == original.attributes and back.events[0].attributes == {"k": 1.5}
    assert back.status.status_code == StatusCode.ERROR and back.status.description == "boom"
    assert back.attributes["tags"] == ("a", "b") and back.instrumentation_scope.name == "inflight.gateway"
    assert back.parent.is_remote and back.kind == SpanKind.SERVER


def test_the_child_ignores_group_signals_and_is_started_again_when_it_dies(collector, monkeypatch):
    monkeypatch.setattr(trace_export, "RESTART_GAP_S", 0.0)
    tr = process_tracing(collector.endpoint)
    sink = tr.sink
    table = JobTable("w1", clock=clock)
    try:
        first = sink._proc
        first.send_signal(signal.SIGTERM)  # Ctrl-C or systemd stopping the group: the worker stops it, not them
        run_job(tr, table, Job(job_id="a", prompt="hi"))
        assert sink.force_flush(30) and sink.num_exported == 9 and first.poll() is None
        with structlog.testing.capture_logs() as logs:
            first.kill()
            first.wait()
            clock.now = 1000.2
            run_job(tr, table, Job(job_id="b", prompt="hi"))  # written into the dead pipe: lost, counted
            deadline = time.monotonic() + 10
            while sink._proc is first and time.monotonic() < deadline:
                time.sleep(0.02)
            clock.now = 1000.2
            run_job(tr, table, Job(job_id="c", prompt="hi"))
            assert sink.force_flush(30)
        assert sink._proc is not first and sink.num_exported == 18 and sink.num_dropped == 9
        assert [x["event"] for x in logs if x["log_level"] == "warning"] == [
            "trace export process exited; spans are dropped until it is started again"]
    finally:
        tr.shutdown(timeout_s=5)
    assert sink._proc.poll() == 0  # the pipe's end stopped it


def test_a_full_queue_drops_spans_instead_of_blocking(collector, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "10")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "10")
    tr = process_tracing(collector.endpoint)
    table = JobTable("w1", clock=clock)
    with structlog.testing.capture_logs() as logs:
        t0 = time.monotonic()
        for i in range(20):
            clock.now = 1000.2
            run_job(tr, table, Job(job_id=f"q{i}", prompt="hi"))
        spent = time.monotonic() - t0
        assert tr.sink.force_flush(30)
    tr.shutdown(timeout_s=5)
    sink = tr.sink
    assert sink.num_dropped > 0 and sink.num_exported + sink.num_dropped == 180
    assert len(collector.spans) == sink.num_exported
    assert [x["event"] for x in logs if x["log_level"] == "warning"] == [
        "trace export queue full: spans are dropped (OTEL_BSP_MAX_QUEUE_SIZE)"]
    assert spent < 5, spent


@pytest.mark.parametrize("export", ["process", "thread"])
def test_batch_settings_that_do_not_fit_are_a_config_error(collector, monkeypatch, export):
    """The SDK checks OTEL_BSP_* where its batch processor is built: in the export process
    that is another process, whose refusal still stops the worker's start with the reason."""
    from worker.config import ConfigError

    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "10")  # the batch size stays 512
    with pytest.raises(ConfigError, match="max_export_batch_size must be less than or equal to max_queue_size"):
        setup_tracing(TracingConfig(enabled=True, endpoint=collector.endpoint, protocol="http/json", export=export),
                      "inflight-worker", set_global=False)


def test_records_encode_to_the_protobuf_the_sdk_encoder_makes():
    """`encode_proto` (the http/protobuf body, built from the records a worker hands over:
    a job's CONSUMER span and its phase spans as `Children`) parses to the same
    ExportTraceServiceRequest the SDK's own encoder makes of the same spans, every field
    (the phases' span ids are drawn at encoding, so they are compared as names; our links
    also carry their trace state, which the SDK's encoder leaves out)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    class Capture:
        records: list = []

        def put(self, record):
            self.records.append(record)

    local = setup_tracing(TracingConfig(enabled=True, capture_content=True), "inflight-worker", instance_id="w1",
                          model="tiny", consumer_group="inflight-workers", exporter=InMemorySpanExporter(),
                          set_global=False)
    local.kit.sink = capture = Capture()
    jobs_both_ways(local, JobTable("w1", clock=clock))
    records = capture.records
    # job 1: its claim-time phases, the rest of its phases, its CONSUMER span; job 2 (never ran): no phases at the end
    assert [type(r).__name__ for r in records] == ["Children", "Children", "SpanRecord", "Children", "SpanRecord"]
    resource = local.provider.resource
    ours = ExportTraceServiceRequest.FromString(encode_proto(records, dict(resource.attributes)))
    sdk = encode_spans(SpanBuilder(resource).spans(records))
    for request in (ours, sdk):
        spans = request.resource_spans[0].scope_spans[0].spans
        names = {s.span_id: s.name.encode() for s in spans}
        for s in spans:
            s.span_id = s.name.encode()
            s.parent_span_id = names.get(s.parent_span_id, s.parent_span_id)
    links = [link for s in ours.resource_spans[0].scope_spans[0].spans for link in s.links]
    assert [link.trace_state for link in links] == ["k=v"]
    for link in links:
        link.ClearField("trace_state")
    assert ours == sdk
    assert len(ours.resource_spans[0].scope_spans[0].spans) == 12


def test_a_child_that_cannot_start_stops_the_start_with_its_reason():
    """What only the child can find out (an exporter it cannot build, a setting it
    refuses) comes back in its first frame and is raised where the worker starts."""
    from worker.config import ConfigError

    with pytest.raises(ConfigError, match="did not start: ConfigError: tracing.protocol must be one of"):
        trace_export.ExportProcess({"tracing": {"protocol": "udp"}}, "nowhere")
