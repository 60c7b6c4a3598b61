"""An OTLP/HTTP span exporter with the JSON encoding (`OTEL_EXPORTER_OTLP_PROTOCOL=http/json`,
`tracing.protocol: http/json`): the OTLP spec's proto3-JSON mapping (hex trace and span
ids, enum values as integers, 64-bit integers as decimal strings), encoded with msgspec.

Why our own: the OpenTelemetry Python SDK ships exporters for `http/protobuf` and `grpc`
only, and its protobuf encoder costs about 8 µs per attribute or event in Python (some
500 µs for the ten spans of one job, `tools/bench/tracing.py`), on a thread that shares
the worker's GIL; this one builds plain dicts and lets msgspec encode them (see
docs/tracing.md for the measured difference). The OTLP spec makes JSON a MAY for
receivers: the OpenTelemetry Collector and Jaeger accept it, some vendors' endpoints do
not; `http/protobuf` stays the default.

Honoured: `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT` (the traces variable is the full URL,
the other a base to which `/v1/traces` is appended), `_HEADERS`, `_TIMEOUT` (seconds),
`_COMPRESSION` (`gzip`), `_CERTIFICATE` (a CA bundle for https).
"""

from __future__ import annotations

import gzip
import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec

_ENCODER = msgspec.json.Encoder()


def _env(name: str) -> str | None:
    return os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")


def traces_url(base: str | None) -> str:
    """The traces URL: `base` + `/v1/traces`, else the traces endpoint variable as it is,
    else the general one + `/v1/traces`, else localhost:4318."""
    if base:
        return base.rstrip("/") + "/v1/traces"
    if full := os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return full
    return (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318").rstrip("/") + "/v1/traces"


def any_value(v: Any) -> dict:
    """An OTLP AnyValue: bool before int (a bool is an int in Python)."""
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


def key_values(attrs: Any) -> list[dict]:
    return [{"key": k, "value": any_value(v)} for k, v in (attrs or {}).items()]


def encode_span(s: Any) -> dict:
    """One ReadableSpan as an OTLP/JSON Span."""
    ctx = s.context
    out: dict[str, Any] = {
        "traceId": format(ctx.trace_id, "032x"), "spanId": format(ctx.span_id, "016x"), "name": s.name,
        "kind": s.kind.value + 1,  # the API's SpanKind starts at INTERNAL = 0, OTLP's at INTERNAL = 1
        "startTimeUnixNano": str(s.start_time), "endTimeUnixNano": str(s.end_time),
        "attributes": key_values(s.attributes),
    }
    if s.parent is not None:
        out["parentSpanId"] = format(s.parent.span_id, "016x")
    if ctx.trace_state:
        out["traceState"] = ctx.trace_state.to_header()
    if s.events:
        out["events"] = [{"timeUnixNano": str(e.timestamp), "name": e.name, "attributes": key_values(e.attributes)}
                         for e in s.events]
    if s.links:
        out["links"] = [{"traceId": format(link.context.trace_id, "032x"), "spanId": format(link.context.span_id, "016x"),
                         "attributes": key_values(link.attributes)} for link in s.links]
    code = s.status.status_code.value  # UNSET 0, OK 1, ERROR 2: OTLP's numbering too
    if code:
        out["status"] = {"code": code, **({"message": s.status.description} if s.status.description else {})}
    return out


def encode_request(spans: Sequence[Any]) -> bytes:
    """An ExportTraceServiceRequest of `spans`, grouped by resource and instrumentation scope."""
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list]]]] = {}
    for s in spans:
        res_group = groups.setdefault(id(s.resource), (s.resource, {}))
        scope = s.instrumentation_scope
        res_group[1].setdefault(id(scope), (scope, []))[1].append(encode_span(s))
    resource_spans = []
    for resource, scopes in groups.values():
        scope_spans = [{"scope": {"name": scope.name if scope else "", "version": (scope.version or "") if scope else ""},
                        "spans": encoded} for scope, encoded in scopes.values()]
        resource_spans.append({"resource": {"attributes": key_values(resource.attributes)}, "scopeSpans": scope_spans})
    return _ENCODER.encode({"resourceSpans": resource_spans})


class OtlpJsonExporter:
    """A SpanExporter posting OTLP/JSON to `endpoint` (the collector's base address;
    None: the environment, see the module docstring). A failed post is retried once
    after 0.5 s when the collector refused it as transient (429, 502-504) or the
    connection failed; the batch is dropped after that (the caller counts it)."""

    def __init__(self, endpoint: str | None = None) -> None:
        import requests
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.util.re import parse_env_headers

        self.url = traces_url(endpoint)
        self.timeout_s = float(_env("TIMEOUT") or 10)
        self.gzip = (_env("COMPRESSION") or "").lower() == "gzip"
        self.session = requests.Session()
        self.session.headers.update(parse_env_headers(_env("HEADERS") or "", liberal=True))
        self.session.headers["Content-Type"] = "application/json"
        if self.gzip:
            self.session.headers["Content-Encoding"] = "gzip"
        if cert := _env("CERTIFICATE"):
            self.session.verify = cert
        self._result = SpanExportResult
        self._requests = requests
        self._shutdown = False

    def export(self, spans: Sequence[Any]):
        if self._shutdown:
            return self._result.FAILURE
        body = encode_request(spans)
        if self.gzip:
            body = gzip.compress(body)
        for attempt in range(2):
            try:
                r = self.session.post(self.url, data=body, timeout=self.timeout_s)
                if r.ok:
                    return self._result.SUCCESS
                if r.status_code not in (429, 502, 503, 504):
                    return self._result.FAILURE
            except self._requests.RequestException:
                pass
            if attempt == 0 and not self._shutdown:
                time.sleep(0.5)
        return self._result.FAILURE

    def shutdown(self) -> None:
        self._shutdown = True
        self.session.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
