"""The gateway's HTTP SERVER span (OpenTelemetry HTTP semantic conventions), the root of a
request's trace, or the child of the caller's when it sent `traceparent`: the job's
PRODUCER span (`worker.client.tracing`) and the worker's spans hang below it. One span
per `/v1/...` request, covering the whole response (a stream included); only installed
when `tracing.enabled`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from worker.gateway.context import CLIENT_GONE


def tracing_middleware(tracing: Any):
    """An aiohttp middleware opening a SERVER span per API request with `tracing`
    (an `OtelTracing`); outermost, so it sees the final status of every request."""
    from opentelemetry import context, trace
    from opentelemetry.trace import Status, StatusCode

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else request.path
        host, _, port = (request.host or "").partition(":")
        attrs = {"http.request.method": request.method, "http.route": route, "url.path": request.path,
                 "url.scheme": request.scheme, "server.address": host,
                 "network.protocol.version": f"{request.version.major}.{request.version.minor}"}
        if port.isdigit():
            attrs["server.port"] = int(port)
        if request.remote:
            attrs["client.address"] = request.remote
        if ua := request.headers.get("User-Agent"):
            attrs["user_agent.original"] = ua[:200]
        span = tracing.server_span(request.method, route, request.headers, attrs)
        token = context.attach(trace.set_span_in_context(span))
        status = 500
        try:
            resp = await handler(request)
            status = 499 if request.get(CLIENT_GONE) else resp.status
            if job_id := resp.headers.get("X-Request-Id"):
                span.set_attribute("inflight.job_id", job_id)
            return resp
        except asyncio.CancelledError:
            status = 499
            span.add_event("client_disconnected")
            raise
        finally:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
                span.set_attribute("error.type", str(status))
            context.detach(token)
            span.end()

    return middleware
