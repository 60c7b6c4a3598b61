"""OpenTelemetry traces of jobs across the queue: one trace per job, from the HTTP request
or the producer to the last token (issue 27; the span layout follows OpenTelemetry's
messaging and GenAI semantic conventions).

Propagation: W3C trace context (`traceparent`, `tracestate`) travels in the Kafka
headers of the job record (and of a cancel record), as OpenTelemetry's Kafka
instrumentations in other languages put it, so a producer in any language that traces
links its span; a record without them starts a new trace (sampled by the configured
sampler; one with them follows its sampled flag).

Spans of one job (times are wall clock; a worker builds its phase spans from
timestamps when the job ends, so no span is opened per step or per token):

    POST /v1/chat/completions        SERVER     gateway (the HTTP request)
    └─ send inflight.jobs.normal     PRODUCER   gateway or InflightClient.submit
       └─ process inflight.jobs.normal  CONSUMER worker, one per attempt
          ├─ read_ahead     record read → claim (waiting in the worker's read-ahead)
          ├─ claim          the Redis claim (ended and exported at once: a worker
          │                 killed later still leaves its attempt in the trace)
          ├─ tokenize       input processing (chat template, tokenizer); a small prompt's
          │                 starts while its claim is in flight (`serve/starter.py`)
          ├─ engine.queue   submitted → first scheduled (the engine's waiting queue)
          ├─ prefill        first scheduled → first token (`prefill_chunk` events)
          ├─ decode         first token → last token
          ├─ publish        terminal event drafted → in Redis
          └─ results.write  results topic (and DLQ) written; the span ends when the
                            record's offset is done
          events: restarted, first_token, preempted (reason), cancel_requested,
                  cancelled, rejected, handed_back, lost

Off (the default) costs nothing: `OFF`'s methods return at once, no job gets a
`JobTrace`, and nothing of OpenTelemetry is imported (this module and `job_trace` import
it only inside `OtelTracing` / `SpanKit`). A sampled-out job gets no `JobTrace` either.
The worker's spans are built as finished spans when the job ends (`worker.obs.job_trace`);
the gateway's and the client's are ordinary SDK spans.
An unreachable collector drops spans (the SDK's batch processor never blocks the
caller) and logs one warning per episode (`ReportingExporter`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import structlog

from worker.obs.exporters import ReportingExporter, export_protocol, export_where, otlp_exporter
from worker.obs.job_trace import JobTrace, SpanKit
from worker.obs.trace_context import ACTIVE, context_from_headers

if TYPE_CHECKING:
    from worker.config import TracingConfig

log = structlog.get_logger(__name__)

SHUTDOWN_S = 5.0  # a stop waits this long for the last exports


class Tracing:
    """Tracing off: every method does nothing and returns at once (`OFF`). The hot path
    only asks `open_job`, which returns None here, so jobs carry no trace."""

    enabled = False
    capture_content = False
    provider: Any = None  # the SDK TracerProvider when on

    def open_job(self, rec: Any, held: Any, claim_start: float, claim_end: float) -> JobTrace | None:
        """Start the CONSUMER span of one attempt of a job just claimed (`rec`: its
        `JobRecord`, `held`: its `LocalJob`; the claim batch ran from `claim_start` to
        `claim_end`, Unix s). None when off or not sampled."""
        return None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued and stop exporting (bounded by `timeout_s`)."""


OFF = Tracing()


def setup_tracing(cfg: TracingConfig, service: str, *, instance_id: str | None = None, model: str | None = None,
                  consumer_group: str | None = None, exporter: Any = None, set_global: bool = True) -> Tracing:
    """`OFF` unless `cfg.enabled`; else an `OtelTracing` exporting over OTLP (or to
    `exporter`, a SpanExporter: tests pass an in-memory one).

    Args:
        service: default `service.name` (`OTEL_SERVICE_NAME`, then `cfg.service_name` win).
        instance_id: `service.instance.id` (the worker id; also `inflight.worker_id`).
        model: `gen_ai.request.model` of the jobs.
        consumer_group: `messaging.consumer.group.name` of the jobs' CONSUMER spans.
        set_global: also make it OpenTelemetry's global tracer provider (so the
            client's PRODUCER spans and any instrumented library in the process use it).
    """
    if not cfg.enabled:
        return OFF
    return OtelTracing(cfg, service, instance_id=instance_id, model=model, consumer_group=consumer_group,
                       exporter=exporter, set_global=set_global)


class OtelTracing(Tracing):
    """Tracing on: an SDK TracerProvider (sampler, ids; the gateway's and the client's
    live spans) whose finished spans go, as `SpanRecord`s, to the trace export process
    (`tracing.export: process`, the default; `worker.obs.trace_export`), or to a
    `RecordBatcher` in this process (`thread`, or when a test passes an SDK `exporter`):
    queue, export thread, `OTEL_BSP_*` honoured, feeding `ReportingExporter`.

    Raises:
        ConfigError: the OpenTelemetry packages are missing (the `tracing` extra).
    """

    enabled = True

    def __init__(self, cfg: TracingConfig, service: str, *, instance_id: str | None = None, model: str | None = None,
                 consumer_group: str | None = None, exporter: Any = None, set_global: bool = True) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        except ImportError as e:
            from worker.config import ConfigError

            raise ConfigError(f"tracing.enabled needs the OpenTelemetry SDK ({e.name} is missing): "
                              "pip install 'inflight-worker[tracing]'") from None
        self._trace = trace
        self.capture_content = cfg.capture_content
        self.model = model
        self.worker_id = instance_id or ""
        self.consumer_group = consumer_group or ""
        for name in ("opentelemetry.exporter", "opentelemetry.sdk.trace.export"):  # ReportingExporter reports
            logging.getLogger(name).setLevel(logging.CRITICAL)
        attrs: dict[str, Any] = {}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attrs["service.name"] = cfg.service_name or service
        if instance_id:
            attrs["service.instance.id"] = instance_id
        sampler = ParentBased(TraceIdRatioBased(cfg.sample_ratio)) if cfg.sample_ratio is not None else None
        self.provider = TracerProvider(resource=Resource.create(attrs), sampler=sampler)
        self.export = "thread" if exporter is not None else cfg.export
        from worker.obs.exporters import batch_settings
        from worker.obs.trace_export import RecordProcessor

        try:
            batch_settings()  # checked here once for both modes: the batcher or the export process reads them again
        except ValueError as e:  # OTEL_BSP_* values that are not numbers or do not fit together
            from worker.config import ConfigError

            raise ConfigError(f"tracing: the OTEL_BSP_* settings: {e}") from None
        if self.export == "process":
            from worker.obs.trace_export import ExportProcess

            protocol = export_protocol(cfg)
            where = export_where(cfg, protocol)
            settings = {"tracing": {"endpoint": cfg.endpoint, "protocol": protocol}, "resource": attrs,
                        "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                        "timeout_s": SHUTDOWN_S}
            self.exporter = self.sink = ExportProcess(settings, where)
        else:
            from worker.obs.exporters import RecordBatcher, SdkRecordExporter

            if exporter is None:
                exporter, protocol, where = otlp_exporter(cfg, self.provider.resource)
            else:  # a test's SDK exporter
                protocol, where = "custom", type(exporter).__name__
                exporter = SdkRecordExporter(exporter, self.provider.resource)
            self.exporter = ReportingExporter(exporter, where)
            self.sink = RecordBatcher(self.exporter)
        self.provider.add_span_processor(RecordProcessor(self.sink))
        self.kit = SpanKit(self.provider, self.sink)
        self.tracer = self.provider.get_tracer("inflight")
        if set_global and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
            trace.set_tracer_provider(self.provider)  # once per process (a second gateway/worker keeps its own)
        log.info("tracing on", endpoint=where, protocol=protocol, export=self.export, service=attrs.get(
            "service.name") or os.environ.get("OTEL_SERVICE_NAME"), sample_ratio=cfg.sample_ratio)

    # ---- the worker's jobs ---------------------------------------------------------------
    def open_job(self, rec: Any, held: Any, claim_start: float, claim_end: float) -> JobTrace | None:
        tp = rec.tp
        job = held.job
        params = job.params
        attrs: dict[str, Any] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": tp.topic,
            "messaging.destination.partition.id": str(tp.partition),
            "messaging.kafka.offset": rec.offset,
            "messaging.kafka.message.key": job.job_id,
            "gen_ai.operation.name": "chat" if job.messages is not None else "text_completion",
            "gen_ai.response.id": job.job_id,
            "inflight.job_id": job.job_id,
            "inflight.priority": held.priority,
            "inflight.attempt": held.attempt,
            "inflight.worker_id": self.worker_id,
        }
        if self.consumer_group:
            attrs["messaging.consumer.group.name"] = self.consumer_group
        if self.model:
            attrs["gen_ai.request.model"] = self.model
        if params.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = params.max_tokens
        attrs["gen_ai.request.temperature"] = params.temperature
        if params.top_p is not None and params.top_p < 1.0:
            attrs["gen_ai.request.top_p"] = params.top_p
        if params.seed is not None:
            attrs["gen_ai.request.seed"] = params.seed
        if job.tenant:
            attrs["inflight.tenant"] = job.tenant
        if held.isolated:
            attrs["inflight.isolated"] = True
        if self.capture_content:
            import msgspec

            attrs["gen_ai.input.messages"] = msgspec.json.encode(
                job.messages if job.messages is not None else job.prompt
                if job.prompt is not None else job.prompt_token_ids).decode()
        read = rec.read_time or claim_start
        jt = JobTrace.open(self.kit, f"process {tp.topic}", context_from_headers(rec.headers), read, attrs,
                           job.job_id, self.capture_content)
        if jt is None:  # not sampled: nothing more for this job
            return None
        if held.attempt > 1:
            jt.event("restarted", {"inflight.attempt": held.attempt,
                                   "inflight.reason": "an earlier attempt did not finish"}, claim_end)
        # emitted now, not when the job ends: a worker killed later still shows this attempt
        jt.children([("read_ahead", read, claim_start, {}, ()),
                     ("claim", claim_start, claim_end, {"inflight.attempt": held.attempt}, ())])
        ACTIVE[job.job_id] = jt
        return jt

    # ---- the gateway's requests ----------------------------------------------------------
    def server_span(self, method: str, route: str, headers: Any, attributes: dict[str, Any]):
        """A started SERVER span for an HTTP request (the gateway's; `headers`: the
        request's, whose `traceparent` makes it a child of the caller's span)."""
        return self.tracer.start_span(f"{method} {route}", context=context_from_headers(headers.items()),
                                      kind=self._trace.SpanKind.SERVER, attributes=attributes)

    def shutdown(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Export what is queued and stop. A collector that does not answer costs at most
        about `timeout_s`: once an export failed, the spans still queued are dropped
        without trying (each try would wait for the exporter's own timeout), and a last
        export still running past the bound is abandoned (with the export process: that
        process is killed, `ExportProcess.shutdown`)."""
        self.provider.shutdown()  # live spans hand over as they end: nothing waits there
        done = self.sink.shutdown(timeout_s)
        if done is False:
            log.warning("trace export did not finish at shutdown; queued spans are dropped",
                        endpoint=self.exporter.where)
