"""The worker's health checks and HTTP endpoint (aiohttp, on the worker's asyncio loop).

    GET /metrics   Prometheus text format of the worker's registry
    GET /healthz   liveness: 200 while the process serves and the engine loop ticks
                   (also while the model loads); 503 once the engine thread died or
                   has not ticked for `metrics.engine_stall_s`. Kubernetes restarts
                   the pod on repeated failures.
    GET /readyz    readiness: 200 when the model is loaded, Kafka and Redis answered the
                   last check (every `metrics.check_interval_s`) and the worker is
                   neither draining nor stopping; else 503. Both health bodies are
                   JSON naming each check.

Readiness does not gate Kafka traffic (the worker pulls work; nothing routes to it),
but it tells operators and rollouts (`maxUnavailable`) which workers can take jobs.
The check loop also refreshes the lag / partition / local-job gauges and notices a
Redis that lost its data while the worker is idle (no publish would notice it).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from worker.config import ConfigError, MetricsConfig
from worker.obs.errors import suppressed
from worker.obs.metrics import exposition
from worker.obs.stopping import honour_cancellation
from worker.security import access, probe
from worker.security.kafka import ping_cluster

if TYPE_CHECKING:
    from worker.engine.core_client import EngineClient
    from worker.obs.metrics import Metrics
    from worker.serve.kafka_outage import KafkaOutage

log = structlog.get_logger(__name__)

CAUSE_LOG_INTERVAL_S = 60.0


class HealthChecks:
    """Outcome of the latest reachability checks and the health bodies built from them.

    Args:
        metrics: the gauges to refresh.
        liveness: returns (alive, details) for /healthz.
    """

    def __init__(self, metrics: Metrics, liveness: Callable[[], tuple[bool, dict]],
                 kafka_outage: KafkaOutage | None = None) -> None:
        self.metrics = metrics
        self.kafka_outage = kafka_outage  # transient Kafka failures of the check are reported there
        self.liveness = liveness
        self.kafka_ok = False
        self.kafka_error: str | None = None
        self.redis_ok = False
        self.redis_error: str | None = None
        self._parts: dict[str, Any] = {}
        self._logged: dict[str, tuple[str, float]] = {}
        self._is_draining: Callable[[], bool] = lambda: False

    def attach(self, redis, intake, claims, publisher, table, engine, *, is_draining: Callable[[], bool]) -> None:
        """The components to probe, once they exist (the HTTP server starts first)."""
        self._parts = {"redis": redis, "intake": intake, "claims": claims, "publisher": publisher, "engine": engine}
        self._is_draining = is_draining
        self.metrics.local_jobs.set_function(lambda: table.num_unfinished)  # current at every scrape

    def readiness(self) -> tuple[bool, dict]:
        """(ready, details) for /readyz: model loaded, Kafka and Redis answered the last
        check, not draining."""
        checks = {
            "model_loaded": "engine" in self._parts,
            "kafka": self.kafka_ok,
            "redis": self.redis_ok,
            "not_draining": not self._is_draining(),
        }
        ready = all(checks.values())
        body: dict = {"status": "ready" if ready else "unready", "checks": checks}
        errors = {k: v for k, v in (("kafka", self.kafka_error), ("redis", self.redis_error)) if v}
        if errors:
            body["errors"] = errors
        return ready, body

    async def run(self, cfg: MetricsConfig) -> None:
        """Check every `check_interval_s`; a failing check never stops the worker."""
        while True:
            honour_cancellation()
            try:
                await self.check(cfg.check_timeout_s)
            except Exception as e:  # e.g. the consumer being recreated
                log.warning("health check failed", error=repr(e)[:300])
            await asyncio.sleep(cfg.check_interval_s)

    async def _kafka_cause(self, e: Exception, cfg, timeout: float) -> str:
        """Why Kafka failed the check: explained if refused (credentials rotated away,
        a certificate expired, an ACL removed), probing once when aiokafka hides it."""
        err = access.explain_kafka(e, cfg)
        if err is None:
            try:
                async with asyncio.timeout(timeout):
                    await probe.probe_kafka(cfg, timeout)
            except access.AccessError as found:
                if found.exit_code != access.EXIT_UNREACHABLE:
                    err = found
            except Exception as probe_error:  # the probe is best effort: keep the check's own error
                log.debug("Kafka probe failed (ignored)", error=repr(probe_error)[:200])
        if err is None:
            return repr(e)[:200] or type(e).__name__
        return str(err)

    def _log_cause(self, service: str, cause: str | None) -> None:
        """Log a failing check's cause when it changes, else at most once per
        CAUSE_LOG_INTERVAL_S (readiness shows it on every request)."""
        now = time.monotonic()
        last = self._logged.get(service)
        if cause and (last is None or last[0] != cause or now - last[1] >= CAUSE_LOG_INTERVAL_S):
            self._logged[service] = (cause, now)
            log.warning("readiness check failed", service=service, cause=cause)

    def stopped_by(self, e: BaseException) -> None:
        """A worker task failed with `e` and the worker is stopping: if `e` is a refusal by
        Redis or Kafka (credentials rotated away, an ACL removed), readiness names it now,
        since the check loop stops with the worker and would keep its last verdict."""
        redis_cfg = self._parts["publisher"].cfg if "publisher" in self._parts else None
        kafka_cfg = self._parts["intake"].cfg if "intake" in self._parts else None
        if redis_cfg is not None and (err := access.explain_redis(e, redis_cfg)) is not None and err.service == "Redis":
            self.redis_ok, self.redis_error = False, str(err)
        elif kafka_cfg is not None and (err := access.explain_kafka(e, kafka_cfg)) is not None:
            self.kafka_ok, self.kafka_error = False, str(err)

    async def check(self, timeout: float) -> None:
        """Redis PING (and the dataset epoch) and, concurrently, Kafka end offsets of the
        assigned job partitions (or `ping_cluster` when none are assigned); sets
        readiness and the lag / partition / local-job / GPU gauges.

        The halves run side by side so one service's verdict never waits for the other's:
        a Kafka request queues behind the consumer's long-poll fetch on the same broker
        connection (up to `fetch_max_wait_ms`), and a timed-out half adds `timeout`."""
        await asyncio.gather(self._check_redis(timeout), self._check_kafka(timeout))
        p, m = self._parts, self.metrics
        if m.gpu_utilization is not None:
            with suppressed(log, "reading GPU utilization"):  # an NVML hiccup keeps the last value
                import torch

                m.gpu_utilization.set(torch.cuda.utilization(p["engine"].device) / 100.0)

    async def _check_redis(self, timeout: float) -> None:
        p = self._parts
        try:
            async with asyncio.timeout(timeout):
                await p["redis"].ping()
            self.redis_ok, self.redis_error = True, None
            epoch = p["claims"].epoch
            async with asyncio.timeout(timeout):
                intact = await p["claims"].epoch_intact()
            if not intact:
                await p["publisher"].restore(epoch)
        except Exception as e:
            err = access.explain_redis(e, p["publisher"].cfg)
            self.redis_ok, self.redis_error = False, str(err) if err is not None else repr(e)[:200]
            self._log_cause("redis", self.redis_error)

    async def _check_kafka(self, timeout: float) -> None:
        m = self.metrics
        intake = self._parts["intake"]
        consumer = intake.consumer
        assigned = sorted(consumer.assignment(), key=lambda tp: (tp.topic, tp.partition))
        try:
            if assigned:
                async with asyncio.timeout(timeout):
                    ends = await consumer.end_offsets(assigned)
                async with asyncio.timeout(timeout):
                    starts = await consumer.beginning_offsets(assigned)
                intake.log_start.update(starts)
                m.consumer_lag.clear()
                for tp, lag in intake.lag(ends).items():
                    m.consumer_lag.labels(tp.topic, str(tp.partition)).set(lag)
            else:
                async with asyncio.timeout(timeout):
                    await ping_cluster(consumer)
                m.consumer_lag.clear()
            self.kafka_ok, self.kafka_error = True, None
            if self.kafka_outage is not None:
                self.kafka_outage.ok("checks")
        except Exception as e:
            self.kafka_ok, self.kafka_error = False, await self._kafka_cause(e, intake.cfg, timeout)
            self._log_cause("kafka", self.kafka_error)
            if self.kafka_outage is not None and not access.is_fatal_kafka(e):
                self.kafka_outage.failed("checks", e)
        m.assigned_partitions.set(len(assigned))
        m.paused_partitions.set(len(consumer.paused()))


class OpsServer:
    """Serves /metrics, /healthz, /readyz. `port` is the bound port after `start` (useful
    with port 0)."""

    def __init__(self, registry: CollectorRegistry, health: HealthChecks, host: str, port: int) -> None:
        self.registry = registry
        self.health = health
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
        body, content_type = exposition(self.registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _healthz(self, request: web.Request) -> web.Response:
        ok, body = self.health.liveness()
        return web.json_response(body, status=200 if ok else 503)

    async def _readyz(self, request: web.Request) -> web.Response:
        ok, body = self.health.readiness()
        return web.json_response(body, status=200 if ok else 503)


LOOP_LAG_WARN_FRACTION = 0.3  # of kafka.session_timeout_ms


async def loop_lag_monitor(metrics: Metrics, session_timeout_ms: int, interval_s: float = 0.1) -> None:
    """How late the event loop wakes a sleeping task (`loop_lag` histogram, seconds): a
    starved loop misses Kafka heartbeats. Logged when above a fraction of the session
    timeout, at most every 10 s. Runs until cancelled."""
    warn_s = session_timeout_ms / 1000 * LOOP_LAG_WARN_FRACTION
    last_warn = 0.0
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(interval_s)
        lag = time.monotonic() - t0 - interval_s
        metrics.loop_lag.observe(max(0.0, lag))
        if lag > warn_s and time.monotonic() - last_warn > 10:
            last_warn = time.monotonic()
            log.warning("event loop lagging; Kafka heartbeats may be missed", lag_s=round(lag, 3),
                        session_timeout_s=session_timeout_ms / 1000)


def nvml_available() -> bool:
    """NVML importable and seeing a GPU (then `gpu_utilization` is exported). Asks NVML
    itself, not torch: the worker's front process does not import torch (its engine
    process does), and on a machine without a GPU driver `nvmlInit` fails at once. GPUs
    hidden from this process (`CUDA_VISIBLE_DEVICES` empty or -1) count as none, as they
    did for torch's `cuda.is_available`."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return False
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


def engine_liveness(client: EngineClient | None, crash: BaseException | None, stall_s: float) -> tuple[bool, dict]:
    """(alive, details) for /healthz: the engine core (`client`, the worker's engine
    client; None while starting) runs and ticked within `stall_s` (`metrics.engine_stall_s`)
    and the worker did not crash (`crash`). True while the model is still loading."""
    if crash is not None:
        return False, {"status": "crashed", "error": repr(crash)[:300]}
    if client is None or client.input is None:
        return True, {"status": "starting"}
    since = time.monotonic() - client.last_tick
    if not client.alive:
        return False, {"status": "engine stopped"}
    if since > stall_s:
        return False, {"status": "engine loop stalled", "since_last_tick_s": round(since, 1)}
    return True, {"status": "ok", "since_last_tick_s": round(since, 3), "steps": client.num_steps}
