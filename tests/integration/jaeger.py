"""Reading traces back from the Jaeger of tools/stack/jaeger.sh (its HTTP query API, as the UI
does), for the tracing tests: one trace as a list of spans with parent links, tags
and events."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import aiohttp

OTLP_HTTP = f"http://127.0.0.1:{os.environ.get('INFLIGHT_DEV_JAEGER_OTLP_HTTP_PORT', '14318')}"
OTLP_GRPC = f"http://127.0.0.1:{os.environ.get('INFLIGHT_DEV_JAEGER_OTLP_GRPC_PORT', '14317')}"
QUERY = f"http://127.0.0.1:{os.environ.get('INFLIGHT_DEV_JAEGER_QUERY_PORT', '16696')}"


@dataclass
class Span:
    name: str
    span_id: str
    trace_id: str
    parent: str | None  # CHILD_OF span id (possibly a span Jaeger does not hold)
    service: str
    start_s: float
    end_s: float
    tags: dict
    events: list[tuple[str, float, dict]] = field(default_factory=list)  # (name, Unix s, fields)
    links: list[str] = field(default_factory=list)  # FOLLOWS_FROM / other-trace span ids

    def event(self, name: str) -> tuple[str, float, dict] | None:
        return next((e for e in self.events if e[0] == name), None)


def _spans(trace: dict) -> list[Span]:
    procs = {k: v["serviceName"] for k, v in trace["processes"].items()}
    out = []
    for s in trace["spans"]:
        parent = None
        links = []
        for ref in s.get("references") or []:
            if ref["refType"] == "CHILD_OF" and ref["traceID"] == s["traceID"] and parent is None:
                parent = ref["spanID"]
            else:
                links.append(ref["spanID"])
        tags = {t["key"]: t["value"] for t in s.get("tags") or []}
        events = []
        for lg in s.get("logs") or []:
            fields = {f["key"]: f["value"] for f in lg["fields"]}
            events.append((fields.pop("event", ""), lg["timestamp"] / 1e6, fields))
        out.append(Span(s["operationName"], s["spanID"], s["traceID"], parent, procs[s["processID"]],
                        s["startTime"] / 1e6, (s["startTime"] + s["duration"]) / 1e6, tags, events, links))
    return out


async def trace(trace_id: str, until=lambda spans: bool(spans), timeout: float = 30.0) -> list[Span]:
    """The spans of one trace, polled until `until(spans)` holds (exports are batched).

    Raises:
        TimeoutError: with what was found.
    """
    deadline = time.monotonic() + timeout
    spans: list[Span] = []
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(f"{QUERY}/api/traces/{trace_id}") as r:
                if r.status == 200:
                    data = (await r.json())["data"] or []
                    spans = _spans(data[0]) if data else []
                    if until(spans):
                        return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"trace {trace_id}: {[(s.service, s.name) for s in spans]}")
            await asyncio.sleep(0.3)


async def find(service: str, tags: dict, n: int = 1, timeout: float = 30.0) -> list[str]:
    """Trace ids of the traces where a span of `service` carries `tags`; polled until at
    least `n` are found."""
    deadline = time.monotonic() + timeout
    found: list[str] = []
    async with aiohttp.ClientSession() as http:
        while True:
            params = {"service": service, "tags": json.dumps(tags), "lookback": "1h", "limit": "50"}
            async with http.get(f"{QUERY}/api/traces", params=params) as r:
                if r.status == 200:
                    found = sorted({t["traceID"] for t in (await r.json())["data"] or []})
                    if len(found) >= n:
                        return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} {tags}: {found}")
            await asyncio.sleep(0.3)


def having(*names: str, count: int = 1):
    """A `trace` poll condition: at least `count` spans of each name are in. Wait for every
    span a check reads, not one of them: each process (gateway, producer, worker) exports
    its spans in batches of its own, so one service's last span says nothing of another's
    (a gateway's server span arrived after the worker's `results.write`)."""
    return lambda spans: all(sum(s.name == n for s in spans) >= count for n in names)


def by_name(spans: list[Span], name: str, service: str | None = None) -> list[Span]:
    return [s for s in spans if s.name == name and (service is None or s.service == service)]
