"""The worker's HTTP endpoint (aiohttp, on the worker's asyncio loop).

    GET /metrics   Prometheus text format of the worker's registry
    GET /healthz   liveness: 200 while the process serves and the engine loop ticks
                   (also while the model loads); 503 once the engine thread died or
                   has not ticked for `metrics.engine_stall_s`. Kubernetes restarts
                   the pod on repeated failures.
    GET /readyz    readiness: 200 when the model is loaded, Kafka and Redis answered the
                   last check (every `metrics.check_interval_s`) and the worker is not
                   draining; else 503. Both health bodies are JSON naming each check.

Readiness does not gate Kafka traffic (the worker pulls work; nothing routes to it),
but it tells operators and rollouts (`maxUnavailable`) which workers can take jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from worker.config import ConfigError

if TYPE_CHECKING:
    from worker.app import Worker

log = structlog.get_logger(__name__)


@dataclass
class Checks:
    """Outcome of the latest reachability checks (written by the worker's check loop)."""

    kafka_ok: bool = False
    kafka_error: str | None = None
    redis_ok: bool = False
    redis_error: str | None = None


class OpsServer:
    """Serves /metrics, /healthz, /readyz for one Worker. `port` is the bound port
    after `start` (useful with port 0)."""

    def __init__(self, worker: Worker, host: str, port: int) -> None:
        self.worker = worker
        self.host = host
        self.port = port
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)

    async def start(self) -> None:
        """Raises:
        ConfigError: the port cannot be bound (in use, or not permitted); names `metrics.port`."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise ConfigError(
                f"metrics.port {self.port} on {self.host} cannot be bound ({e.strerror}); give each worker on a host "
                "its own port, 0 for any free one, or null to serve no HTTP"
            ) from None
        self.port = self._runner.addresses[0][1]  # the bound port (port 0 picks one)
        log.info("http endpoint listening", host=self.host, port=self.port, paths=["/metrics", "/healthz", "/readyz"])

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.worker.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        ok, body = self.worker.liveness()
        return web.json_response(body, status=200 if ok else 503)

    async def _readyz(self, request: web.Request) -> web.Response:
        ok, body = self.worker.readiness()
        return web.json_response(body, status=200 if ok else 503)

