"""OTLP ExportTraceServiceRequest bodies built straight from span records
(`worker.obs.span_records`: `SpanRecord` and `Children`), in the two encodings of
OTLP/HTTP: protobuf (`encode_proto`, the default `http/protobuf`) and the proto3 JSON
mapping (`encode_json`, `http/json`: hex ids, enum values as integers, 64-bit integers
as decimal strings).

Why our own: the OpenTelemetry Python SDK's encoder builds one protobuf message object
per attribute, event and span from its `ReadableSpan`s: ~700 µs for the nine spans of one
job on the 2-core box (plus ~120 µs to build those spans), against ~80 µs here: each
(key, value) attribute field is made once and reused, and a job's phase spans encode
their shared fields once (`tests/unit/test_trace_export.py` checks the bytes parse to
what the SDK's encoder makes; docs/benchmarks.md#tracing-overhead). Field numbers
and flags follow opentelemetry-proto's `trace/v1/trace.proto` and `common/v1/common.proto`:
a span carries `flags` (bit 8: the parent's remoteness is known, bit 9: it is remote), as
the SDK sets them; a link also carries its trace state.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from worker.obs.span_records import UNSET, Children, Record, SpanRecord, expand, span_id_bytes
from worker.obs.trace_context import ns

_JSON = msgspec.json.Encoder()
_FIXED64 = struct.Struct("<Q")
_FIXED32 = struct.Struct("<I")
_DOUBLE = struct.Struct("<d")
HAS_IS_REMOTE, IS_REMOTE = 0x100, 0x200


# ---- protobuf ------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,)) if n >= 0 else _varint(n & 0xFFFFFFFFFFFFFFFF)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the length, the payload."""
    n = len(payload)
    return tag + (bytes((n,)) if n < 0x80 else _varint(n)) + payload


def _any(v: Any) -> bytes:
    """An AnyValue message."""
    t = type(v)
    if t is str:
        return _field(b"\x0a", v.encode())
    if t is bool:
        return b"\x10\x01" if v else b"\x10\x00"
    if t is int:
        return b"\x18" + _varint(v)
    if t is float:
        return b"\x21" + _DOUBLE.pack(v)
    if t is tuple or t is list:
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any(x)) for x in v))
    if t is bytes:
        return _field(b"\x3a", v)
    return _field(b"\x0a", str(v).encode())


_FIELDS: dict[bytes, dict[tuple[str, Any], bytes]] = {}


def _key_values(tag: bytes, attributes: dict) -> bytes:
    """Repeated KeyValue fields (`tag`: the field's tag byte in its message). Most
    attributes repeat from job to job (topic, worker, model, operation names, small
    counts): each (key, value) pair's whole field is made once per tag and kept (bounded;
    a value that never repeats costs one insert)."""
    fields = _FIELDS.get(tag)
    if fields is None:
        fields = _FIELDS[tag] = {}
    parts = []
    for item in attributes.items():
        try:
            f = fields.get(item)
        except TypeError:  # a list value: not hashable
            f = None
            item = (item[0], tuple(item[1]))
        if f is None:
            if len(fields) >= 8192:
                fields.clear()
            f = fields[item] = _field(tag, _field(b"\x0a", item[0].encode()) + _field(b"\x12", _any(item[1])))
        parts.append(f)
    return b"".join(parts)


def _span_proto(r: SpanRecord) -> bytes:
    parts = [_field(b"\x0a", r.trace_id), b"\x12\x08" + r.span_id.to_bytes(8, "big")]
    if r.trace_state:
        parts.append(_field(b"\x1a", r.trace_state.encode()))
    if r.parent_id:
        parts.append(b"\x22\x08" + r.parent_id.to_bytes(8, "big"))
    parts += [_field(b"\x2a", r.name.encode()), b"\x30" + bytes((r.kind + 1,)),
              b"\x39" + _FIXED64.pack(r.start_ns), b"\x41" + _FIXED64.pack(r.end_ns),
              _key_values(b"\x4a", r.attributes)]
    for name, t, attrs in r.events:
        parts.append(_field(b"\x5a", b"\x09" + _FIXED64.pack(t) + _field(b"\x12", name.encode())
                            + _key_values(b"\x1a", attrs)))
    for tid, sid, state, attrs in r.links:
        link = _field(b"\x0a", tid) + b"\x12\x08" + sid.to_bytes(8, "big")
        if state:
            link += _field(b"\x1a", state.encode())
        parts.append(_field(b"\x6a", link + _key_values(b"\x22", attrs) + b"\x35"
                            + _FIXED32.pack(HAS_IS_REMOTE | IS_REMOTE)))
    status = b""
    if r.status != UNSET:
        status = (_field(b"\x12", r.description.encode()) if r.description else b"") + b"\x18" + bytes((r.status,))
    parts.append(_field(b"\x7a", status))
    parts.append(b"\x85\x01" + _FIXED32.pack(HAS_IS_REMOTE | (IS_REMOTE if r.parent_remote else 0)))
    return b"".join(parts)


_KIND_TIMES = struct.Struct("<BBBQBQ")  # kind INTERNAL, start and end (fields 6, 7, 8 of a Span)
_NAMES: dict[str, bytes] = {}


def _children_proto(r: Children) -> Iterator[bytes]:
    """The child spans of one `Children` record: what they share is encoded once, their
    names once per process, their ids drawn here."""
    head = _field(b"\x0a", r.trace_id) + b"\x12\x08"
    middle = (_field(b"\x1a", r.trace_state.encode()) if r.trace_state else b"") + b"\x22\x08" + r.parent_id.to_bytes(
        8, "big")
    tail = b"\x7a\x00\x85\x01" + _FIXED32.pack(HAS_IS_REMOTE)  # status unset; the parent is local
    names = _NAMES
    for name, start, end, attributes, events in r.spans:
        named = names.get(name)
        if named is None:
            named = names[name] = _field(b"\x2a", name.encode())
        parts = [head, span_id_bytes(), middle, named,
                 _KIND_TIMES.pack(0x30, 1, 0x39, int(start * 1e9), 0x41, int(max(start, end) * 1e9))]
        if attributes:
            parts.append(_key_values(b"\x4a", attributes))
        for ename, t, attrs in events:
            parts.append(_field(b"\x5a", b"\x09" + _FIXED64.pack(ns(t)) + _field(b"\x12", ename.encode())
                                + _key_values(b"\x1a", attrs)))
        parts.append(tail)
        yield _field(b"\x12", b"".join(parts))


def _by_scope(records: Iterable[Record]) -> dict[str, list[Record]]:
    scopes: dict[str, list[Record]] = {}
    for r in records:
        found = scopes.get(r.scope)
        if found is None:
            found = scopes[r.scope] = []
        found.append(r)
    return scopes


def encode_proto(records: Iterable[Record], resource: dict[str, Any]) -> bytes:
    """An ExportTraceServiceRequest (protobuf) of `records`, all of one `resource`
    (its attributes), grouped by instrumentation scope."""
    scope_spans = []
    for scope, found in _by_scope(records).items():
        parts = [_field(b"\x0a", _field(b"\x0a", scope.encode()) if scope else b"")]
        for r in found:
            if type(r) is SpanRecord:
                parts.append(_field(b"\x12", _span_proto(r)))
            else:
                parts.extend(_children_proto(r))
        scope_spans.append(_field(b"\x12", b"".join(parts)))
    resource_spans = _field(b"\x0a", _key_values(b"\x0a", resource)) + b"".join(scope_spans)
    return _field(b"\x0a", resource_spans)


# ---- JSON ----------------------------------------------------------------------------------
def any_value(v: Any) -> dict:
    """An OTLP/JSON AnyValue: bool before int (a bool is an int in Python)."""
    if isinstance(v, str):
        return {"stringValue": v}
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [any_value(x) for x in v]}}
    if isinstance(v, bytes):
        import base64

        return {"bytesValue": base64.b64encode(v).decode()}
    return {"stringValue": str(v)}


def key_values(attrs: dict | None) -> list[dict]:
    return [{"key": k, "value": any_value(v)} for k, v in (attrs or {}).items()]


def span_json(r: SpanRecord) -> dict:
    """One record as an OTLP/JSON Span."""
    out: dict[str, Any] = {
        "traceId": r.trace_id.hex(), "spanId": format(r.span_id, "016x"), "name": r.name,
        "kind": r.kind + 1,  # the API's SpanKind starts at INTERNAL = 0, OTLP's at INTERNAL = 1
        "startTimeUnixNano": str(r.start_ns), "endTimeUnixNano": str(r.end_ns),
        "attributes": key_values(r.attributes),
        "flags": HAS_IS_REMOTE | (IS_REMOTE if r.parent_remote else 0),
    }
    if r.parent_id:
        out["parentSpanId"] = format(r.parent_id, "016x")
    if r.trace_state:
        out["traceState"] = r.trace_state
    if r.events:
        out["events"] = [{"timeUnixNano": str(t), "name": name, "attributes": key_values(attrs)}
                         for name, t, attrs in r.events]
    if r.links:
        out["links"] = [{"traceId": tid.hex(), "spanId": format(sid, "016x"), "attributes": key_values(attrs),
                         "flags": HAS_IS_REMOTE | IS_REMOTE, **({"traceState": state} if state else {})}
                        for tid, sid, state, attrs in r.links]
    if r.status != UNSET:  # UNSET 0, OK 1, ERROR 2: OTLP's numbering too
        out["status"] = {"code": r.status, **({"message": r.description} if r.description else {})}
    return out


def encode_json(records: Iterable[Record], resource: dict[str, Any]) -> bytes:
    """An ExportTraceServiceRequest (OTLP/JSON) of `records`, all of one `resource`."""
    scope_spans = [{"scope": {"name": scope}, "spans": [span_json(r) for r in expand(found)]}
                   for scope, found in _by_scope(records).items()]
    return _JSON.encode({"resourceSpans": [{"resource": {"attributes": key_values(resource)},
                                            "scopeSpans": scope_spans}]})
