"""Finished spans as compact records: what a worker hands to its trace export process
(`worker.obs.trace_export`) over a pipe, and what the exporters encode
(`worker.obs.otlp_encode`) or turn back into the SDK's `ReadableSpan`s (`SpanBuilder`,
for the gRPC exporter).

Two kinds: `SpanRecord` (one span: the gateway's and client's SDK spans, a job's CONSUMER
span) and `Children` (a job's phase spans under its CONSUMER span, as one record whose
span ids are drawn where it is expanded). Both hold plain values only (ids as integers
and bytes, times as numbers, attributes as a dict), so building one costs the event loop
a fraction of an SDK span, and msgpack (msgspec) encodes a batch of them in microseconds.
The resource is not in the record: the export process builds the one resource of the
process that sends to it. Attribute sequences come back as tuples (msgpack has no tuple).

Imports OpenTelemetry only inside `SpanBuilder`, which runs only while tracing is on.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import msgspec

from worker.obs.trace_context import ns

# OpenTelemetry's SpanKind values (API numbering, INTERNAL = 0) and StatusCode values
INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER = range(5)
UNSET, OK, ERROR = range(3)


class SpanRecord(msgspec.Struct, array_like=True, gc=False, tag=0):
    """One finished span.

    Attributes:
        name: the span's name.
        trace_id: the 128-bit trace id, 16 bytes big-endian.
        span_id: the 64-bit span id.
        parent_id: the parent span's id; 0 for a root span.
        parent_remote: the parent is another process's span (a producer's).
        trace_state: the W3C `tracestate` header value; "" for none.
        kind: SpanKind value (`INTERNAL` … `CONSUMER`).
        start_ns, end_ns: Unix nanoseconds.
        attributes: the span's attributes.
        events: (name, Unix ns, attributes) per event, in time order.
        links: (trace id bytes, span id, trace state header, attributes) per link.
        status: StatusCode value (`UNSET`, `OK`, `ERROR`).
        description: the status's description (errors only), or None.
        scope: the instrumentation scope's name.
    """

    name: str
    trace_id: bytes
    span_id: int
    parent_id: int
    parent_remote: bool
    trace_state: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    links: list[tuple[bytes, int, str, dict[str, Any]]]
    status: int = UNSET
    description: str | None = None
    scope: str = "inflight"


class Children(msgspec.Struct, array_like=True, gc=False, tag=1):
    """Finished INTERNAL child spans of one parent span, as one record: a job's phase spans
    (`worker.obs.job_trace`). Their span ids are drawn where the record is expanded
    (`expand`: in the export process), so the event loop draws one id per job, not one
    per phase.

    Attributes:
        trace_id, parent_id, trace_state, scope: as in `SpanRecord` (the parent's).
        spans: (name, start, end, attributes, events) per child, times in Unix seconds
            (turned into nanoseconds where expanded: the event loop skips that too);
            events as (name, Unix s, attributes).
    """

    trace_id: bytes
    parent_id: int
    trace_state: str
    spans: list[tuple[str, float, float, dict[str, Any], list[tuple[str, float, dict[str, Any]]]]]
    scope: str = "inflight"


Record = SpanRecord | Children


def num_spans(records: Iterable[Record]) -> int:
    """How many spans `records` hold."""
    return sum(1 if type(r) is SpanRecord else len(r.spans) for r in records)


def expand(records: Iterable[Record]) -> list[SpanRecord]:
    """Every span of `records` as a SpanRecord (children get fresh span ids)."""
    out: list[SpanRecord] = []
    for r in records:
        if type(r) is SpanRecord:
            out.append(r)
            continue
        for name, start, end, attributes, events in r.spans:
            out.append(SpanRecord(name, r.trace_id, span_id(), r.parent_id, False, r.trace_state, INTERNAL, ns(start),
                                  ns(max(start, end)), attributes, [(n, ns(t), a) for n, t, a in events], [], UNSET,
                                  None, r.scope))
    return out


_IDS = random.Random()  # seeded from os.urandom; a program seeding the global `random` cannot repeat our ids


def span_id() -> int:
    """A random nonzero 64-bit span id (W3C trace context)."""
    while True:
        sid = _IDS.getrandbits(64)
        if sid:
            return sid


def span_id_bytes() -> bytes:
    """`span_id` as its 8 bytes (big-endian), as OTLP's protobuf carries it."""
    while True:
        sid = _IDS.randbytes(8)
        if sid != b"\0\0\0\0\0\0\0\0":
            return sid


def trace_bytes(trace_id: int) -> bytes:
    """A 128-bit trace id as the record's 16 bytes."""
    return trace_id.to_bytes(16, "big")


def link_of(context: Any, attributes: dict | None = None) -> tuple[bytes, int, str, dict]:
    """A record's link to a SpanContext (e.g. a cancel record's producer span)."""
    state = context.trace_state
    return (trace_bytes(context.trace_id), context.span_id, state.to_header() if state else "", attributes or {})


def record_of(span: Any) -> SpanRecord:
    """A ReadableSpan (an ordinary SDK span, ended: the gateway's SERVER spans, the
    client's PRODUCER spans) as a record."""
    ctx = span.context
    parent = span.parent
    state = ctx.trace_state
    status = span.status
    scope = span.instrumentation_scope
    return SpanRecord(
        span.name, trace_bytes(ctx.trace_id), ctx.span_id, parent.span_id if parent is not None else 0,
        bool(parent is not None and parent.is_remote), state.to_header() if state else "", span.kind.value,
        span.start_time, span.end_time, dict(span.attributes or {}),
        [(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events],
        [link_of(link.context, dict(link.attributes or {})) for link in span.links],
        status.status_code.value, status.description, scope.name if scope is not None else "")


def _tuples(attributes: dict) -> dict:
    """msgpack returns sequences as lists; SDK attributes hold tuples."""
    for key, value in attributes.items():
        if type(value) is list:
            attributes[key] = tuple(value)
    return attributes


class SpanBuilder:
    """Turns records back into ReadableSpans for one process's `resource` (the export
    process: one builder, many records; trace states and scopes are parsed once)."""

    def __init__(self, resource: Any) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
        from opentelemetry.trace.span import TraceState

        self.resource = resource
        self._Event, self._ReadableSpan, self._Link, self._SpanContext = Event, ReadableSpan, Link, SpanContext
        self._Scope, self._TraceState, self._Status = InstrumentationScope, TraceState, Status
        self._kinds = list(SpanKind)
        self._codes = {c.value: c for c in StatusCode}
        self._unset = Status(StatusCode.UNSET)
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._scopes: dict[str, Any] = {}
        self._states: dict[str, Any] = {"": None}

    def _state(self, header: str) -> Any:
        state = self._states.get(header)
        if state is None and header:
            if len(self._states) > 1024:
                self._states = {"": None}
            state = self._states[header] = self._TraceState.from_header([header])
        return state

    def _context(self, trace_id: int, span_id: int, state: str, remote: bool = False) -> Any:
        return self._SpanContext(trace_id, span_id, is_remote=remote, trace_flags=self._sampled,
                                 trace_state=self._state(state))

    def span(self, r: SpanRecord) -> Any:
        """The ReadableSpan of record `r`."""
        trace_id = int.from_bytes(r.trace_id, "big")
        scope = self._scopes.get(r.scope)
        if scope is None:
            scope = self._scopes[r.scope] = self._Scope(r.scope)
        parent = self._context(trace_id, r.parent_id, r.trace_state, r.parent_remote) if r.parent_id else None
        status = self._unset if r.status == UNSET else self._Status(self._codes[r.status], r.description)
        return self._ReadableSpan(
            name=r.name, context=self._context(trace_id, r.span_id, r.trace_state), parent=parent,
            resource=self.resource, attributes=_tuples(r.attributes),
            events=tuple(self._Event(name, _tuples(attrs), t) for name, t, attrs in r.events),
            links=tuple(self._Link(self._context(int.from_bytes(tid, "big"), sid, state, True), _tuples(attrs))
                        for tid, sid, state, attrs in r.links),
            kind=self._kinds[r.kind], status=status, start_time=r.start_ns, end_time=r.end_ns,
            instrumentation_scope=scope)

    def spans(self, records: Iterable[Record]) -> list:
        return [self.span(r) for r in expand(records)]
