"""PRODUCER spans for the records `InflightClient` sends (jobs and cancels), with the W3C
trace context in the record's Kafka headers, so a worker's CONSUMER span of the job
joins the caller's trace (`worker.obs.tracing` draws the whole tree; OpenTelemetry's
messaging semantic conventions name the attributes).

When: `tracing=None` (the default) traces while the application has installed an
OpenTelemetry SDK tracer provider (the gateway with `tracing.enabled`, or any program
that set up OpenTelemetry) and costs nothing otherwise; `True` always (the OpenTelemetry
API must be installed); `False` never. The span is the current one while the record is
sent, so it is the child of whatever span the caller is in (an HTTP request's).
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

from worker.obs.trace_context import headers_for

Send = Callable[[str, bytes, bytes, list | None], Awaitable[Any]]
_API: Any = None  # the opentelemetry.trace module once imported; False: not installed


def _otel_trace() -> Any:
    global _API
    if _API is None:
        try:
            from opentelemetry import trace
        except ImportError:
            _API = False
        else:
            _API = trace
    return _API


class ProducerSpans:
    """PRODUCER spans and W3C trace context for the records a client produces (nothing while tracing is off).

    Args: tracing (None: while the application traces; True; False), tracer_provider
        (None: OpenTelemetry's global one).

    Raises:
        RuntimeError: `tracing=True` without the OpenTelemetry API installed.
    """

    def __init__(self, tracing: bool | None = None, tracer_provider: Any = None) -> None:
        self.mode = tracing
        self.provider = tracer_provider
        self._tracer = None
        if tracing and not _otel_trace():
            raise RuntimeError("InflightClient(tracing=True) needs OpenTelemetry: pip install opentelemetry-api")

    def tracer(self) -> Any:
        """The tracer to use now, or None (no span, no headers)."""
        if self.mode is False:
            return None
        # default mode: an application that set up OpenTelemetry has imported its API;
        # nothing is imported (or tried) otherwise
        trace = _otel_trace() if self.mode or self.provider is not None else sys.modules.get("opentelemetry.trace")
        if not trace:
            return None
        if self.mode is None and self.provider is None and isinstance(trace.get_tracer_provider(),
                                                                      trace.ProxyTracerProvider):
            return None  # the application set up no SDK: it does not trace
        if self._tracer is None:
            self._tracer = trace.get_tracer("inflight.client", tracer_provider=self.provider)
        return self._tracer

    async def send(self, send: Send, topic: str, value: bytes, key: bytes, attributes: dict[str, Any]) -> Any:
        """`send(topic, value, key, headers)` inside a PRODUCER span `send <topic>` whose
        context travels in the headers; returns what `send` returns (RecordMetadata)."""
        tracer = self.tracer()
        if tracer is None:
            return await send(topic, value, key, None)
        attrs = {"messaging.system": "kafka", "messaging.operation.type": "send", "messaging.operation.name": "send",
                 "messaging.destination.name": topic, "messaging.kafka.message.key": key.decode("utf-8", "replace"),
                 **attributes}
        with tracer.start_as_current_span(f"send {topic}", kind=_otel_trace().SpanKind.PRODUCER,
                                          attributes=attrs) as span:
            md = await send(topic, value, key, headers_for() or None)
            if md is not None and span.is_recording():
                span.set_attribute("messaging.destination.partition.id", str(md.partition))
                span.set_attribute("messaging.kafka.offset", md.offset)
            return md
