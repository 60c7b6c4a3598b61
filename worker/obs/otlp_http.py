"""OTLP/HTTP span export of `SpanRecord`s (`tracing.protocol`: `http/protobuf`, the
default, or `http/json`), the bodies built by `worker.obs.otlp_encode`.

Why our own: the OpenTelemetry Python SDK's HTTP exporter encodes its `ReadableSpan`s one
protobuf message object per attribute (~700 µs for the nine spans of a job on the 2-core
box) and ships no JSON exporter; records encode in ~80 µs a job (JSON ~110 µs). The OTLP
spec makes JSON a MAY for receivers: the OpenTelemetry Collector and Jaeger accept it,
some vendors' endpoints do not; protobuf is every receiver's MUST and the default.

Honoured: `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT` (the traces variable is the full URL,
the other a base to which `/v1/traces` is appended), `_HEADERS`, `_TIMEOUT` (seconds),
`_COMPRESSION` (`gzip`), `_CERTIFICATE` (a CA bundle for https), `_CLIENT_CERTIFICATE`
and `_CLIENT_KEY` (mTLS).
"""

from __future__ import annotations

import gzip
import os
import time
from collections.abc import Sequence
from typing import Any


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


class OtlpHttpExporter:
    """Posts records as OTLP/HTTP to `endpoint` (the collector's base address; None: the
    environment, see the module docstring), in `protocol`'s encoding, with `resource`'s
    attributes. A failed post is retried once after 0.5 s when the collector refused it as
    transient (429, 502-504) or the connection failed; the batch is dropped after that (the
    caller counts it)."""

    def __init__(self, endpoint: str | None, protocol: str, resource: dict[str, Any]) -> None:
        import requests
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.util.re import parse_env_headers

        from worker.obs.otlp_encode import encode_json, encode_proto

        self.url = traces_url(endpoint)
        self.encode = encode_json if protocol == "http/json" else encode_proto
        self.resource = dict(resource)
        self.timeout_s = float(_env("TIMEOUT") or 10)
        self.gzip = (_env("COMPRESSION") or "").lower() == "gzip"
        self.session = requests.Session()
        self.session.headers.update(parse_env_headers(_env("HEADERS") or "", liberal=True))
        self.session.headers["Content-Type"] = "application/json" if protocol == "http/json" else \
            "application/x-protobuf"
        if self.gzip:
            self.session.headers["Content-Encoding"] = "gzip"
        if cert := _env("CERTIFICATE"):
            self.session.verify = cert
        if client_cert := _env("CLIENT_CERTIFICATE"):  # mTLS
            self.session.cert = (client_cert, _env("CLIENT_KEY")) if _env("CLIENT_KEY") else client_cert
        self._result = SpanExportResult
        self._requests = requests
        self._shutdown = False

    def export(self, records: Sequence[Any]):
        if self._shutdown:
            return self._result.FAILURE
        body = self.encode(records, self.resource)
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
