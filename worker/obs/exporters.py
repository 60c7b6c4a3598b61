"""From finished-span records to the collector: the OTLP exporter `tracing.protocol` or
the `OTEL_EXPORTER_OTLP_*` variables choose (`otlp_exporter`: our OTLP/HTTP one for
`http/protobuf` and `http/json`, the SDK's for `grpc`), `ReportingExporter` (one warning
per failing episode, counts) and `RecordBatcher` (the SDK batch span processor's rules,
`OTEL_BSP_*`, over records). They run in the trace export process
(`worker.obs.trace_export`) or, with `tracing.export: thread`, in the serving process."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

from worker.obs.span_records import num_spans

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
    from worker.obs.otlp_http import traces_url

    return traces_url(cfg.endpoint)


def otlp_exporter(cfg: TracingConfig, resource: Any):
    """The OTLP exporter of records `cfg` and the `OTEL_EXPORTER_OTLP_*` variables
    describe, for spans of `resource` (an SDK Resource). Returns (exporter, protocol,
    endpoint for logs)."""
    protocol = export_protocol(cfg)
    where = export_where(cfg, protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        endpoint = cfg.endpoint
        grpc = GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://") if endpoint else None)
        return SdkRecordExporter(grpc, resource), protocol, where
    from worker.obs.otlp_http import OtlpHttpExporter

    return OtlpHttpExporter(cfg.endpoint, protocol, resource.attributes), protocol, where


class SdkRecordExporter:
    """An SDK SpanExporter (the gRPC one; a test's in-memory one) fed records: each batch
    becomes ReadableSpans of `resource` first."""

    def __init__(self, inner: Any, resource: Any) -> None:
        from worker.obs.span_records import SpanBuilder

        self.inner = inner
        self.builder = SpanBuilder(resource)

    def export(self, records: Sequence[Any]):
        return self.inner.export(self.builder.spans(records))  # children expanded there

    def shutdown(self) -> None:
        self.inner.shutdown()


class ReportingExporter:
    """Wraps an exporter of records: a failed export (collector unreachable, refused)
    drops its batch and logs one warning per episode, with the count dropped when exports
    work again; the SDK's own per-batch error lines are silenced. Runs in the batcher's
    thread, never on the event loop or in the engine."""

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
        self.failed = 0  # spans of failed exports (the batcher's thread writes it)
        self.queue_dropped = 0  # spans that found the batcher's queue full (the putting thread writes it)
        self._episode_dropped = 0

    @property
    def num_dropped(self) -> int:
        return self.failed + self.queue_dropped

    def export(self, spans: Sequence[Any]):
        result = self._export(spans)
        if self.listener is not None:
            self.listener()
        return result

    def _export(self, spans: Sequence[Any]):
        n = num_spans(spans)
        if self.closing and self.failing:  # no retry of an unreachable collector at shutdown
            self.failed += n
            return self._failure
        try:
            result = self.inner.export(spans)
            error = None
        except Exception as e:  # an exporter bug must not kill the processor's thread
            result, error = self._failure, e
        if result == self._ok:
            self.num_exported += n
            if self.failing:
                self.failing = False
                if self.log_episodes:
                    log.info("trace export works again", endpoint=self.where, dropped_spans=self._episode_dropped)
                self._episode_dropped = 0
            return result
        self.failed += n
        self._episode_dropped += n
        self.last_error = repr(error)[:200] if error else ""
        if not self.failing:
            self.failing = True
            if self.log_episodes:
                log.warning("trace export failed: spans are dropped until the collector answers; jobs are "
                            "unaffected", endpoint=self.where, error=self.last_error or "export refused or unreachable")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def batch_settings() -> tuple[float, int, int]:
    """(schedule delay s, max queue size, max export batch size) from `OTEL_BSP_*`, with
    the SDK's defaults (5000 ms, 2048, 512).

    Raises:
        ValueError: a value that is not a positive integer, or a batch larger than the queue.
    """
    delay_ms = _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000)
    queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
    batch = _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
    if batch > queue:
        raise ValueError("max_export_batch_size must be less than or equal to max_queue_size.")
    return delay_ms / 1000, queue, batch


class RecordBatcher:
    """Sends finished-span records to `exporter` (a `ReportingExporter`) in batches from
    its own thread, by the SDK batch span processor's rules: a batch goes when
    `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` records wait or `OTEL_BSP_SCHEDULE_DELAY` passed; a
    record that finds `OTEL_BSP_MAX_QUEUE_SIZE` waiting is dropped and counted. `put` never
    blocks.

    Raises:
        ValueError: invalid `OTEL_BSP_*` values (`batch_settings`).
    """

    def __init__(self, exporter: ReportingExporter) -> None:
        self.exporter = exporter
        self.delay_s, self.max_queue, self.batch_size = batch_settings()
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._flush_asked = 0
        self._flush_done = 0
        self._thread = threading.Thread(target=self._run, name="inflight-trace-batches", daemon=True)
        self._thread.start()

    def put(self, record: Any) -> None:
        q = self._queue
        if len(q) >= self.max_queue:
            self.exporter.queue_dropped += num_spans((record,))
            return
        q.append(record)
        if len(q) == self.batch_size:
            with self._cond:
                self._cond.notify()

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export every record queued now; False if that took longer than `timeout_s`."""
        with self._cond:
            self._flush_asked += 1
            want = self._flush_asked
            self._cond.notify()
            deadline = time.monotonic() + timeout_s
            while self._flush_done < want:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued (bounded by `timeout_s`; once exports failed, the rest
        is dropped untried) and stop the exporter. False if the thread did not finish."""
        self.exporter.closing = True
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self.exporter.shutdown()
        return True

    def _run(self) -> None:
        q = self._queue
        while True:
            with self._cond:
                if len(q) < self.batch_size and not self._closing and self._flush_asked == self._flush_done:
                    self._cond.wait(self.delay_s)
                flush = self._flush_asked
                closing = self._closing
            while q:
                batch = [q.popleft() for _ in range(min(len(q), self.batch_size))]
                self.exporter.export(batch)
                if len(q) < self.batch_size and not closing and flush == self._flush_done:
                    break  # a part batch waits for the delay, unless a flush or the end wants it out
            with self._cond:
                self._flush_done = flush
                self._cond.notify_all()
            if closing:
                return
