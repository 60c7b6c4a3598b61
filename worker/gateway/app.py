"""`inflight gateway`: the process. Wires the HTTP application (aiohttp) to the Kafka
producer and Redis streams (`InflightClient`), the key ring, the file store and the
batch manager, and runs their lifecycle: start (config, keys, file store, Kafka and Redis
reachable) → serve → SIGTERM: stop accepting, let open requests finish (bounded by
`gateway.drain_timeout_s`), stop batch drivers (their leases lapse to other gateways) →
close.

Routes: the OpenAI endpoints (`worker.gateway.completions`, `worker.gateway.batch.api`),
`GET /v1/models`, and without a key `/healthz` (alive), `/readyz` (Kafka, Redis and the
file store answered the last check) and `/metrics` (Prometheus).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time

import structlog
from aiohttp import web
from aiokafka.errors import KafkaError

from schemas import keys
from worker.client import InflightClient
from worker.config import ConfigError
from worker.config.worker import pool_set
from worker.gateway.agents import OutputFormats
from worker.gateway.auth import KeyRing
from worker.gateway.batch.api import BatchHandlers
from worker.gateway.batch.manager import BatchManager
from worker.gateway.batch.state import BatchStore
from worker.gateway.completions import CompletionHandlers
from worker.gateway.config import GatewayFileConfig
from worker.gateway.context import CLIENT_GONE, AdapterNames, GatewayContext, error_response, json_ok
from worker.gateway.errors import ApiError
from worker.gateway.files import FileStore
from worker.gateway.generation import CancelSender
from worker.gateway.liveness import FleetLiveness, NoLiveWorker
from worker.gateway.metrics import GatewayMetrics
from worker.gateway.render import TokenText
from worker.gateway.responses import ResponsesHandlers
from worker.gateway.tokenize import TokenizeHandlers
from worker.gateway.tracing import tracing_middleware
from worker.obs.metrics import exposition
from worker.obs.stopping import honour_cancellation, start_unless_stopped, stop_within
from worker.obs.tracing import setup_tracing
from worker.security.access import AccessError

log = structlog.get_logger(__name__)

CHECK_INTERVAL_S = 5.0
CHECK_TIMEOUT_S = 3.0


def context_length(tokenizer: str | None) -> int | None:
    """`max_position_embeddings` (or GPT-2's `n_positions`) of the checkpoint directory
    `tokenizer` points at; None when it is not a directory with a readable config.json."""
    if tokenizer is None or not os.path.isdir(tokenizer):
        return None
    try:
        with open(os.path.join(tokenizer, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    value = cfg.get("max_position_embeddings") or cfg.get("n_positions")
    return value if isinstance(value, int) and value > 0 else None


class Gateway:
    """One gateway process.

    Args:
        cfg: the gateway config file (`gateway`, `kafka`, `redis` sections).
        gateway_id: unique per process (batch leases); default hostname-pid.
    """

    def __init__(self, cfg: GatewayFileConfig, gateway_id: str | None = None) -> None:
        self.cfg = cfg
        self.gateway_id = gateway_id or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = GatewayMetrics()
        self.port = cfg.gateway.port
        self._checks: dict[str, str | None] = {"kafka": "not checked yet", "redis": "not checked yet",
                                               "files": "not checked yet", "workers": "not checked yet"}
        self._liveness_unknown_logged = False
        self._unknown_groups_logged: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()
        self.started = asyncio.Event()
        self._runner: web.AppRunner | None = None
        # built by start(); None until then (stop() closes what exists)
        self.client: InflightClient | None = None
        self.ctx: GatewayContext | None = None
        self.files: FileStore | None = None
        self.batches: BatchManager | None = None
        self._created = int(time.time())
        self._max_model_len: int | None = cfg.gateway.max_model_len or context_length(cfg.gateway.tokenizer)
        self.tracing = setup_tracing(cfg.tracing, "inflight-gateway", instance_id=self.gateway_id,
                                     model=cfg.gateway.model_name)

    def _edge_context(self) -> int | None:
        """The context the gateway refuses prompts beyond (`worker.gateway.edge`):
        `gateway.max_model_len` when set; else the checkpoint's, unless pools route by
        prompt length (a pool may run a longer context than the checkpoint states, set in
        its workers' `model.max_model_len`, which the gateway cannot see): then none."""
        if self.cfg.gateway.max_model_len is not None:
            return self.cfg.gateway.max_model_len
        return None if pool_set(self.cfg.pools).routes else self._max_model_len

    async def start(self) -> None:
        """Raises:
        ConfigError: bad keys, tokenizer or files directory; the port cannot be bound;
            the job topics do not exist.
        AccessError: Kafka or Redis refused the credentials (see `worker.security.access`)."""
        g = self.cfg.gateway
        keyring = KeyRing.from_config(g)
        tokens = TokenText(g.tokenizer)
        try:
            files = FileStore(g.files_dir)
        except OSError as e:
            raise ConfigError(f"gateway.files_dir: cannot create {g.files_dir!r} ({e.strerror})") from None
        self.client = InflightClient(kafka=self.cfg.kafka, redis=self.cfg.redis, tracing=self.tracing.enabled,
                                     tracer_provider=self.tracing.provider, pools=self.cfg.pools,
                                     tokenizer=tokens.tokenizer)
        await self._check_topics()
        ctx = GatewayContext(cfg=g, client=self.client, keys=keyring, metrics=self.metrics,
                             cancels=CancelSender(self.client, lambda r: self.metrics.cancels.labels(r).inc()),
                             tokens=tokens, adapters=AdapterNames(g.adapters, g.lora_dir),
                             formats=OutputFormats.resolve(g.tool_parser, g.reasoning_parser, g.constrained_tool_calls,
                                                           g.tokenizer),
                             fleet=FleetLiveness(g.model_name, g.no_worker_grace_s),
                             max_model_len=self._edge_context())
        self.ctx = ctx
        self.files = files
        store = BatchStore(self.client.redis, files, self.cfg.redis.key_prefix, self.gateway_id, g.batch_lease_ms,
                           self.client.topic_prefix)
        self.batches = BatchManager(ctx, store, files)
        middlewares = [tracing_middleware(self.tracing), self._middleware] if self.tracing.enabled else [
            self._middleware]
        app = web.Application(middlewares=middlewares, client_max_size=g.max_body_bytes)
        gen, bat = CompletionHandlers(ctx), BatchHandlers(ctx, files, self.batches)
        app.router.add_post("/v1/chat/completions", gen.chat)
        app.router.add_post("/v1/completions", gen.completions)
        resp = ResponsesHandlers(ctx)
        app.router.add_post("/v1/responses", resp.create)
        app.router.add_get("/v1/responses/{response_id}", resp.get)
        app.router.add_delete("/v1/responses/{response_id}", resp.delete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/v1/files", bat.upload)
        app.router.add_get("/v1/files/{file_id}", bat.file)
        app.router.add_get("/v1/files/{file_id}/content", bat.content)
        app.router.add_post("/v1/batches", bat.create)
        app.router.add_get("/v1/batches", bat.list)
        app.router.add_get("/v1/batches/{batch_id}", bat.get)
        app.router.add_post("/v1/batches/{batch_id}/cancel", bat.cancel)
        tok = TokenizeHandlers(ctx, self._max_model_len)  # vLLM's server utilities
        app.router.add_post("/tokenize", tok.tokenize)
        app.router.add_post("/detokenize", tok.detokenize)
        app.router.add_get("/version", tok.version)
        app.router.add_get("/health", self._health)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        # handler_cancellation: a client that disconnects cancels its handler at once,
        # which sends its job's cancel (worker.gateway.completions)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     shutdown_timeout=g.drain_timeout_s)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, g.host, g.port, reuse_address=True).start()
        except OSError as e:
            runner, self._runner = self._runner, None  # stop() has no server to clean up
            await runner.cleanup()
            raise ConfigError(f"gateway.port {g.port} on {g.host} cannot be bound ({e.strerror})") from None
        self.port = self._runner.addresses[0][1]
        self._created = int(time.time())
        await self._check()
        self._tasks = [asyncio.create_task(self.batches.run(), name="batches"),
                       asyncio.create_task(self._check_loop(), name="checks")]
        self.started.set()
        log.info("gateway started", gateway_id=self.gateway_id, host=g.host, port=self.port, model=g.model_name,
                 keys=len(keyring), files_dir=g.files_dir, batch_priority=g.batch_priority)

    async def _check_topics(self) -> None:
        prefix = self.client.topic_prefix
        pools = self.client.pools
        wanted = [t for t in keys.all_topics(prefix, pools) if t != keys.dlq_topic(prefix)]
        missing = []
        for t in wanted:
            async with asyncio.timeout(15):
                if not await self.client.partitions_for(t):
                    missing.append(t)
        if missing:
            how = "--config <a worker's config file>" if pools.routes else f"--prefix {prefix}"
            raise ConfigError(f"kafka.topic_prefix {prefix!r}: missing topics {', '.join(missing)}; create them: "
                              f"inflight topics create {how}")

    async def run(self, install_signals: bool = True) -> None:
        """Start, serve until SIGTERM/SIGINT (or `request_stop`), then stop. A stop requested
        during the start cancels the start (`worker.obs.stopping.start_unless_stopped`); a
        start that fails stops what it built before the error propagates."""
        if install_signals:  # before the start: a SIGTERM while the brokers answer slowly stops the start
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            if await start_unless_stopped(self.start(), self._stop, "gateway"):
                await self._stop.wait()
        finally:
            await self.stop()

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (bounded by `gateway.drain_timeout_s`),
        stop the scan, the checks and the batch drivers, send the cancels still queued,
        close the clients. Every step is bounded (`worker.obs.stopping`): at most
        2 × `drain_timeout_s` + about 60 s in all, whatever a step waits on."""
        drain_s = self.cfg.gateway.drain_timeout_s
        if self._runner is not None:  # aiohttp bounds its own wait for handlers by 2 x drain_s
            await stop_within("gateway: HTTP server", self._runner.cleanup(), 2 * drain_s + 5)
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await stop_within("gateway: batch scan and readiness checks",
                              asyncio.gather(*self._tasks, return_exceptions=True), 10)
        if self.batches is not None:
            await self.batches.stop()
            await self.ctx.cancels.drain()
        if self.client is not None:
            await stop_within("gateway: Kafka and Redis clients", self.client.close(), 20)
        if self.tracing.enabled:
            await stop_within("gateway: trace export", asyncio.to_thread(self.tracing.shutdown), 10)
        log.info("gateway stopped", gateway_id=self.gateway_id)

    # ---- middleware: errors in OpenAI's format, request metrics -----------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        t0 = time.monotonic()
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        status = 500
        try:
            resp = await handler(request)
            status = 499 if request.get(CLIENT_GONE) else resp.status
            return resp
        except ApiError as e:
            status = e.status
            if status >= 500:
                log.warning("request failed", endpoint=endpoint, status=status, error=e.message)
            return error_response(e)
        except web.HTTPException as e:  # aiohttp's own: no such route, method, body too large
            status = e.status
            return error_response(ApiError(e.status, e.reason, code=e.reason.lower().replace(" ", "_")))
        except asyncio.CancelledError:
            status = 499  # the client closed the connection
            raise
        except Exception as e:
            log.exception("unhandled error", endpoint=endpoint, error=repr(e)[:300])
            return error_response(ApiError(500, "internal error", code="internal"))
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.duration.labels(endpoint).observe(time.monotonic() - t0)

    # ---- small routes ------------------------------------------------------------------------
    def _model_obj(self, model: str) -> dict:
        obj = {"id": model, "object": "model", "created": self._created, "owned_by": "inflight"}
        base = self.cfg.gateway.model_name
        if model != base:  # a LoRA adapter: vLLM's fields
            obj.update(root=model.partition(":")[2], parent=base)
        if self._max_model_len is not None:
            obj["max_model_len"] = self._max_model_len
        return obj

    async def _models(self, request: web.Request) -> web.Response:
        grant = self.ctx.grant(request)
        return json_ok({"object": "list", "data": [self._model_obj(m) for m in self.ctx.models(grant)]})

    async def _model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        self.ctx.check_model(model, self.ctx.grant(request))
        return json_ok(self._model_obj(model))

    async def _healthz(self, request: web.Request) -> web.Response:
        return json_ok({"status": "ok", "gateway_id": self.gateway_id})

    async def _health(self, request: web.Request) -> web.Response:
        """vLLM's `/health`: 200 with an empty body while the gateway can serve (its
        readiness: Kafka, Redis, the files directory), else 503 with `/readyz`'s body."""
        if self._ready:
            return web.Response(status=200)
        return await self._readyz(request)

    @property
    def _ready(self) -> bool:
        """Every readiness check passed its last round and no stop was asked for."""
        return not any(self._checks.values()) and not self._stop.is_set()

    async def _readyz(self, request: web.Request) -> web.Response:
        ready = self._ready
        body = {"status": "ready" if ready else "unready", "checks": {k: v is None for k, v in self._checks.items()},
                "batches_driven": len(self.batches.driving), "live_workers": self.ctx.fleet.counts}
        errors = {k: v for k, v in self._checks.items() if v}
        if errors:
            body["errors"] = errors
        return json_ok(body, status=200 if ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = exposition(self.metrics.registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    # ---- readiness -------------------------------------------------------------------------------
    async def _check(self) -> None:
        async def probe(name: str, call) -> None:
            try:
                honour_cancellation()  # the previous check's client swallowed a stop's cancel
                async with asyncio.timeout(CHECK_TIMEOUT_S):
                    await call()
                self._checks[name] = None
            except Exception as e:
                cause = str(e) if isinstance(e, NoLiveWorker) else repr(e)[:200] or type(e).__name__
                if self._checks.get(name) != cause:
                    log.warning("readiness check failed", service=name, cause=cause)
                self._checks[name] = cause

        # side by side: one service's verdict never waits for another's timeout
        await asyncio.gather(probe("redis", self.client.redis.ping), probe("kafka", self.client.ping_kafka),
                             probe("files", lambda: asyncio.to_thread(self._files_writable)),
                             probe("workers", self._live_workers))

    async def _live_workers(self) -> None:
        """Count each pool's live workers (`worker.gateway.liveness`). Raises
        NoLiveWorker when the default pool has had none for the grace; counts that cannot
        be had (no permission to describe the groups, Kafka down: its own check says so)
        leave liveness unknown, refusing nothing."""
        fleet = self.ctx.fleet
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S / 2):
                counts = await self.client.live_workers()
        except (KafkaError, AccessError, OSError, TimeoutError) as e:
            if fleet.counts is not None or not self._liveness_unknown_logged:
                log.warning("cannot count live workers (the consumer groups could not be described); requests are "
                            "queued without a liveness check", cause=repr(e)[:200])
                self._liveness_unknown_logged = True
            fleet.update(None)
            self.metrics.live_workers.clear()
            return
        fleet.update(counts)
        for pool, n in counts.items():
            if n is None:
                if pool not in self._unknown_groups_logged:
                    self._unknown_groups_logged.add(pool)
                    pools = pool_set(self.cfg.pools)
                    log.warning("the consumer group of this pool is unknown to Kafka (no worker ever committed "
                                "under it): no liveness check for it; check that kafka.group_id is the workers'",
                                pool=pool, group_id=pools.group_id(pools.get(pool), self.cfg.kafka.group_id))
                with contextlib.suppress(KeyError):
                    self.metrics.live_workers.remove(pool)
                continue
            self.metrics.live_workers.labels(pool).set(n)
        why = fleet.readiness_error()
        if why is not None:
            raise NoLiveWorker(why)

    def _files_writable(self) -> None:
        if not os.access(self.files.root, os.W_OK):
            raise PermissionError(f"{self.files.root} is not writable")

    async def _check_loop(self) -> None:
        while True:
            honour_cancellation()  # a check whose client swallowed the stop's cancel ends here
            await asyncio.sleep(CHECK_INTERVAL_S)
            await self._check()
