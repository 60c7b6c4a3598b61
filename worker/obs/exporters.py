"""The OTLP span exporters a tracing setup sends through (`otlp_exporter`: the SDK's
http/protobuf and gRPC exporters, our http/json one in `worker.obs.otlp_json`), chosen by
`tracing.protocol` or the `OTEL_EXPORTER_OTLP_*` variables, and `ReportingExporter`, which
turns failed exports into one warning per episode and counts. Used in the serving process
(`tracing.export: thread`) or in the trace export process (`worker.obs.trace_export`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from worker.config import TracingConfig

log = structlog.get_logger(__name__)


def export_protocol(cfg: TracingConfig) -> str:
    """The OTLP protocol `cfg` or the `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL` variables name.

    Raises:
        ConfigError: a protocol not in `TRACING_PROTOCOLS`.
    """
    protocol = (cfg.protocol or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    from worker.config import TRACING_PROTOCOLS, ConfigError

    if protocol not in TRACING_PROTOCOLS:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL must be one of {list(TRACING_PROTOCOLS)}, "
                          f"got {protocol!r}")
    return protocol


def export_where(cfg: TracingConfig, protocol: str) -> str:
    """The collector's address spans go to, for log lines."""
    if protocol == "grpc":
        return cfg.endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4317"
    from worker.obs.otlp_json import traces_url

    return traces_url(cfg.endpoint)


def otlp_exporter(cfg: TracingConfig):
    """The OTLP span exporter `cfg` and the `OTEL_EXPORTER_OTLP_*` variables describe.
    Returns (exporter, protocol, endpoint for logs)."""
    protocol = export_protocol(cfg)
    where = export_where(cfg, protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        endpoint = cfg.endpoint
        return GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://") if endpoint else None), \
            protocol, where
    if protocol == "http/json":
        from worker.obs.otlp_json import OtlpJsonExporter

        return OtlpJsonExporter(cfg.endpoint), protocol, where
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    endpoint = cfg.endpoint.rstrip("/") + "/v1/traces" if cfg.endpoint else None
    return HttpExporter(endpoint=endpoint), protocol, where


class ReportingExporter:
    """Wraps a SpanExporter: a failed export (collector unreachable, refused) drops its
    batch and logs one warning per episode, with the count dropped when exports work
    again; the SDK's own per-batch error lines are silenced. Runs in the batch
    processor's thread, never on the event loop or in the engine."""

    def __init__(self, inner: Any, where: str, *, log_episodes: bool = True) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.inner = inner
        self.where = where
        self.log_episodes = log_episodes  # False in the export process: the worker logs from its counts
        self.listener: Any = None  # called after every export (the export process reports its counts)
        self.last_error = ""
        self._ok = SpanExportResult.SUCCESS
        self._failure = SpanExportResult.FAILURE
        self.failing = False
        self.closing = False  # shutting down: once the collector failed, the rest is dropped untried
        self.num_exported = 0
        self.num_dropped = 0
        self._episode_dropped = 0

    def export(self, spans: Sequence[Any]):
        result = self._export(spans)
        if self.listener is not None:
            self.listener()
        return result

    def _export(self, spans: Sequence[Any]):
        if self.closing and self.failing:  # no retry of an unreachable collector at shutdown
            self.num_dropped += len(spans)
            return self._failure
        try:
            result = self.inner.export(spans)
            error = None
        except Exception as e:  # an exporter bug must not kill the processor's thread
            result, error = self._failure, e
        if result == self._ok:
            self.num_exported += len(spans)
            if self.failing:
                self.failing = False
                if self.log_episodes:
                    log.info("trace export works again", endpoint=self.where, dropped_spans=self._episode_dropped)
                self._episode_dropped = 0
            return result
        self.num_dropped += len(spans)
        self._episode_dropped += len(spans)
        self.last_error = repr(error)[:200] if error else ""
        if not self.failing:
            self.failing = True
            if self.log_episodes:
                log.warning("trace export failed: spans are dropped until the collector answers; jobs are "
                            "unaffected", endpoint=self.where, error=self.last_error or "export refused or unreachable")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
