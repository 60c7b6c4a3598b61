"""W3C trace context in Kafka headers (`traceparent`, `tracestate`), the registry of
traced jobs a worker holds and the log processor that reads it. Imports OpenTelemetry only
inside the functions that need it (`context_from_headers`, `headers_for`), which run only
while tracing is on or for a client whose application traces."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = (TRACEPARENT, TRACESTATE)

# job id -> its JobTrace (worker.obs.job_trace) while this worker holds the job: log
# lines about it carry the trace and span ids (`add_trace_ids`). Empty while tracing is off.
ACTIVE: dict[str, Any] = {}


def ns(t: float) -> int:
    """Unix seconds -> Unix nanoseconds (OpenTelemetry's timestamps)."""
    return int(t * 1e9)


def add_trace_ids(logger: Any, method: str, event_dict: dict) -> dict:
    """structlog processor: a line about a traced job (its `job_id` field) gets that
    job's `trace_id` and `span_id` (hex, as the back ends show them)."""
    if ACTIVE:
        job_id = event_dict.get("job_id")
        if job_id is not None:
            t = ACTIVE.get(job_id)
            if t is not None:
                event_dict.setdefault("trace_id", t.trace_id)
                event_dict.setdefault("span_id", t.span_id)
    return event_dict


def _carrier(headers: Iterable[tuple[str, bytes | str | None]] | None) -> dict[str, str]:
    """The trace-context entries of Kafka headers (`[(name, value bytes)]`) or HTTP
    headers (`[(name, value str)]`), as text."""
    found: dict[str, str] = {}
    for name, value in headers or ():
        key = name.lower()
        if key in TRACE_HEADERS and value is not None:
            if isinstance(value, str):
                found[key] = value
                continue
            try:
                found[key] = value.decode("ascii")
            except (UnicodeDecodeError, AttributeError):
                continue  # not a W3C header value: ignored, the record starts a new trace
    return found


def context_from_headers(headers: Iterable[tuple[str, bytes | str | None]] | None):
    """The OpenTelemetry Context a record's (or an HTTP request's) `traceparent` /
    `tracestate` headers carry, or None (no headers, or an invalid `traceparent`: the job
    or request starts a new trace)."""
    carrier = _carrier(headers)
    if TRACEPARENT not in carrier:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def headers_for(context=None) -> list[tuple[str, bytes]]:
    """Kafka headers carrying `context` (default: the current one) as W3C trace
    context; empty when it holds no valid span."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=context)
    return [(k, v.encode("ascii")) for k, v in carrier.items()]
