"""Worker: wires intake, job starter, engine client, publisher, cancel listener and the
HTTP endpoint, and runs their lifecycle.

Lifecycle (as arq): start → run → drain(deadline) → close. SIGTERM/SIGINT stop intake,
let running jobs finish until `worker.drain_timeout_s`, hand the rest back (aborted
without a terminal event, claims released, offsets left uncommitted so another worker
re-runs them with `restarted`), commit, leave the group, close. Every wait in drain and
close is bounded, so a broken connection can delay shutdown but never hang it.

Who owns what, and a job's path through these parts step by step:
docs/concepts.md#how-a-job-flows (told there once).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from typing import TYPE_CHECKING

import structlog
from aiokafka import AIOKafkaProducer, TopicPartition
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas.output_formats import detect
from worker.config import WorkerConfig, redacted_config
from worker.config.engine import DEFAULT_MAX_OUTPUT_TOKENS
from worker.engine.core_client import EngineClient, ProcessEngineClient, make_engine_client
from worker.engine.core_proc import EngineSpec
from worker.engine.gc_tuning import tune_gc
from worker.engine.vllm_spec import engine_spec as engine_spec_for
from worker.obs.metrics import Metrics
from worker.obs.stacks import task_stacks
from worker.obs.stopping import start_unless_stopped, stop_within
from worker.obs.tracing import setup_tracing
from worker.security.kafka import kafka_security_kwargs, stop_client
from worker.security.probe import verify_access
from worker.security.redis import REDIS_DOWN, redis_client
from worker.serve.cancels import CancelListener
from worker.serve.claim_scripts import TAKE_LUA
from worker.serve.claims import ClaimStore
from worker.serve.dlq import DeadLetters
from worker.serve.finalize import Finalizer
from worker.serve.fleet_quota import SYNC_LUA, FleetQuota, fleet_limits_configured
from worker.serve.health import HealthChecks, OpsServer, engine_liveness, loop_lag_monitor, nvml_available
from worker.serve.intake import Intake
from worker.serve.jobs import JobState, JobTable
from worker.serve.kafka_outage import KafkaOutage
from worker.serve.leases import ClaimLeases
from worker.serve.local_job import Round
from worker.serve.offsets import OffsetTracker
from worker.serve.pool_router import PoolRouter, check_pool_limits
from worker.serve.publish import Publisher
from worker.serve.read_ahead import JobRecord, high_priority_reserve, local_shares
from worker.serve.results import ResultsLog
from worker.serve.starter import JobStarter

if TYPE_CHECKING:
    from collections import Counter

    from redis.asyncio import Redis

    from worker.engine import Engine, RequestOutput
    from worker.serve.local_job import LocalJob

log = structlog.get_logger(__name__)


class Worker:
    """One worker process: a consumer-group member around one engine.

    Args:
        cfg: the whole configuration.
        engine: an Engine to step in a thread of this process (tests, embedding).
        engine_spec: how to build the engine otherwise (default: the checkpoint at
            `cfg.model.path`); it runs in its own process unless `worker.engine_process`
            is false.
    """

    def __init__(self, cfg: WorkerConfig, engine: Engine | None = None, engine_spec: EngineSpec | None = None) -> None:
        self.cfg = cfg
        self.worker_id = cfg.worker.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._engine = engine
        self._engine_spec = engine_spec or engine_spec_for(cfg.model.path, cfg.engine)
        self.max_local_jobs = cfg.worker.max_local_jobs or 2 * cfg.serving_tuning.max_running_requests
        self.table = JobTable(self.worker_id, compact_logs=cfg.redis.compact_logs)
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self.metrics = Metrics(gpu=nvml_available(), tenant_labels=cfg.metrics.tenant_labels,
                               tenant_rank_interval_s=cfg.metrics.tenant_rank_interval_s)
        self.draining = False
        self.engine: EngineClient | None = None
        self._stop_requested = asyncio.Event()
        self._stopping = asyncio.Event()
        self.started = asyncio.Event()  # set once every component runs
        self._crash: BaseException | None = None
        self._tasks: list[asyncio.Task] = []
        self.leases: ClaimLeases | None = None
        # built by start(), in this order; None until then (close() stops what exists)
        self.redis: Redis | None = None
        self.claims: ClaimStore | None = None
        self.publisher: Publisher | None = None
        self.producer: AIOKafkaProducer | None = None
        self.dead_letters: DeadLetters | None = None
        self.results: ResultsLog | None = None
        self.finalizer: Finalizer | None = None
        self.starter: JobStarter | None = None
        self.intake: Intake | None = None
        self.cancels: CancelListener | None = None
        self.quota: FleetQuota | None = None  # fleet-wide tenant limits, when a tenant policy sets one
        self.kafka_outage = KafkaOutage(cfg.kafka.outage_limit_s, self.metrics)
        self.health = HealthChecks(self.metrics, kafka_outage=self.kafka_outage, liveness=lambda: engine_liveness(
            self.engine, self._crash, cfg.metrics.engine_stall_s))
        self.server = (OpsServer(self.metrics.registry, self.health, cfg.metrics.host, cfg.metrics.port)
                       if cfg.metrics.port is not None else None)
        self.tracing = setup_tracing(cfg.tracing, "inflight-worker", instance_id=self.worker_id,
                                     model=os.path.basename(cfg.model.path.rstrip("/")) or None,
                                     consumer_group=cfg.job_group_id)

    def _fleet_quota(self) -> FleetQuota:
        """The fleet-wide tenant limits (fleet_quota.py): a job's charge is settled when
        it stops counting as held."""
        quota = FleetQuota(self.redis, self.cfg.redis.key_prefix, self.worker_id, self.cfg.serving_tuning,
                           default_max_tokens=self.engine.tuning.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS,
                           metrics=self.metrics)
        self.table.on_release = self._settle_charge
        return quota

    def _quota_tasks(self, tenant_cap) -> list[asyncio.Task]:
        """The fleet limits' sync rounds, when a tenant has one."""
        if self.quota is None:
            return []
        return [asyncio.create_task(self.quota.run(self.intake.read_ahead.waiting_by_tenant, self._holding_by_tenant,
                                                   tenant_cap), name="fleet-quota")]

    def _holding_by_tenant(self) -> Counter[str]:
        """What this worker's fleet slot reservations cover, per tenant: jobs held,
        records being claimed (`JobStarter.holding_by_tenant`) and records contested
        (`Intake.contested_by_tenant`)."""
        return self.starter.holding_by_tenant() + self.intake.contested_by_tenant()

    async def _release_quota(self) -> None:
        try:
            await self.quota.release()
        except REDIS_DOWN as e:  # its slots lapse with their lease instead
            log.warning("could not release the fleet limits' reservations", error=repr(e)[:200])

    def _settle_charge(self, held: LocalJob) -> None:
        """A job with a fleet-rate charge stops counting as held: what it did not use back."""
        self.quota.settle(held.tenant or "", held.charge, held.prompt_tokens + held.num_tokens)

    @property
    def num_local_jobs(self) -> int:
        """Jobs held before their terminal event: what `worker.max_local_jobs` bounds."""
        return self.table.num_unfinished

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        log.info("starting worker", worker_id=self.worker_id, config=redacted_config(cfg))
        if self.server is not None:  # first, so /healthz answers while the model loads
            await self.server.start()
        fleet_limits = fleet_limits_configured(cfg.serving_tuning)
        scripts = (TAKE_LUA, SYNC_LUA) if fleet_limits else (TAKE_LUA,)
        await verify_access(cfg, redis_scripts=scripts)  # wrong credentials, certificates or ACLs: fail now, before the model loads
        self.redis = redis_client(cfg.redis, health_check_interval=15,
                                  retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
                                  retry_on_error=[RedisConnectionError, RedisTimeoutError])
        rc = cfg.redis
        self.claims = ClaimStore(self.redis, rc.key_prefix, self.worker_id, lease_ms=rc.claim_lease_ms,
                                 ttl_s=rc.log_ttl_s, tombstone_ttl_s=rc.tombstone_ttl_s)
        await self.claims.adopt_epoch()
        self.leases = ClaimLeases(self.table, self.claims, self.metrics, rc.claim_lease_ms, self)
        self.publisher = Publisher(self.redis, rc, self.claims, self.table, on_outage=self._on_redis_outage,
                                   on_lost=self.leases.hand_back_lost,
                                   on_restore=self._on_restored,
                                   on_backlog=self.metrics.publish_backlog.set)
        loop = asyncio.get_running_loop()
        self.engine = await make_engine_client(self._engine, self._engine_spec, cfg.serving_tuning, self.metrics,
                                               cfg.worker.engine_process, log_level=cfg.worker.log_level,
                                               engine_threads=cfg.worker.engine_threads)
        await self.engine.start(loop, self._on_step, self._on_crash)
        kc = cfg.kafka
        self.producer = AIOKafkaProducer(bootstrap_servers=kc.bootstrap_servers, client_id=f"{self.worker_id}-out",
                                         max_request_size=kc.max_partition_fetch_bytes + 1024 * 1024, acks="all",
                                         enable_idempotence=True, linger_ms=2, **kafka_security_kwargs(kc))
        await self.kafka_outage.ride_out("producer", self.producer.start)  # a broker away at start: wait for it
        self.dead_letters = DeadLetters(self.producer, kc.topic_prefix, self.worker_id)
        self.results = ResultsLog(self.producer, kc.topic_prefix)
        self.finalizer = Finalizer(self.table, self.tracker, self.dead_letters, self.results, self.metrics,
                                   outage=self.kafka_outage)
        router = PoolRouter(cfg.pool_set, cfg.pool, kc.topic_prefix, self.producer)
        check_pool_limits(cfg, self.engine.tuning.max_input_tokens, self.engine.input.facts.max_model_len)
        self.metrics.pool_info.labels(cfg.worker.pool).set(1)
        self.quota = self._fleet_quota() if fleet_limits else None
        self.cancels = CancelListener(kc, self.worker_id, self.cancel, self.producer.partitions_for,
                                      outage=self.kafka_outage)
        self.starter = JobStarter(self.table, self.claims, self.engine, self.finalizer, self.metrics, self, self.cancels,
                                  max_local_jobs=self.max_local_jobs, max_job_failures=cfg.worker.max_job_failures,
                                  poison_grace_s=cfg.worker.poison_grace_s,
                                  tokenizer_threads=cfg.worker.tokenizer_threads, tracing=self.tracing, router=router,
                                  quota=self.quota)
        reserve = high_priority_reserve(cfg.serving_tuning, cfg.worker, self.max_local_jobs)
        tenant_weight, tenant_cap = local_shares(cfg.serving_tuning, cfg.worker, self.max_local_jobs, reserve)
        self.intake = Intake(kc, self.worker_id, self.starter, self.tracker, metrics=self.metrics,
                             read_ahead_per_partition=cfg.worker.read_ahead_per_partition,
                             read_ahead_bytes=cfg.worker.read_ahead_bytes, tenant_weight=tenant_weight,
                             tenant_cap=tenant_cap, fair=cfg.serving_tuning.fair_share,
                             high_priority_reserve=reserve,
                             outage=self.kafka_outage, pool=cfg.worker.pool, group_id=cfg.job_group_id,
                             quota=self.quota)
        await self.kafka_outage.ride_out("intake", self.intake.start)
        await self.kafka_outage.ride_out("cancels", self.cancels.start)
        self.table.output_formats = detect(getattr(self.engine.tokenizer, "chat_template", None))
        self.health.attach(self.redis, self.intake, self.claims, self.publisher, self.table, self.engine,
                           is_draining=lambda: self.draining or self._stop_requested.is_set() or self._stopping.is_set())
        self._tasks = [
            asyncio.create_task(self.publisher.run(self._on_published), name="publisher"),
            asyncio.create_task(self.finalizer.run(), name="finalize"),
            asyncio.create_task(self.intake.run(self._stopping), name="intake"),
            asyncio.create_task(self.cancels.run(self._stopping), name="cancels"),
            asyncio.create_task(self.leases.run(), name="claims"),
            asyncio.create_task(self.health.run(cfg.metrics), name="checks"),
            asyncio.create_task(self.kafka_outage.watch(), name="kafka"),
            asyncio.create_task(loop_lag_monitor(self.metrics, cfg.kafka.session_timeout_ms), name="loop-lag"),
            *self._quota_tasks(tenant_cap),
        ]
        tune_gc()  # start-up's objects (imports, a thread-mode engine's model) frozen out of the collector's scans
        self.started.set()
        log.info("worker started", worker_id=self.worker_id, pool=cfg.worker.pool, group_id=cfg.job_group_id,
                 max_local_jobs=self.max_local_jobs, kv_blocks=self.engine.num_blocks,
                 engine_process=isinstance(self.engine, ProcessEngineClient), engine_threads=self.engine.engine_threads,
                 forward=self.engine.forward)

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def run(self, install_signals: bool = True) -> None:
        """Start, serve until SIGTERM/SIGINT (or `request_stop`), drain, close. A stop
        requested during the start cancels the start and closes what it built
        (`worker.obs.stopping.start_unless_stopped`).

        Raises:
            the exception that stopped the worker (engine failure, RedisUnavailable).
        """
        if install_signals:  # before the start: a SIGTERM while the model loads stops the start
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            loop.add_signal_handler(signal.SIGUSR1, self.dump_tasks)
        try:
            started = await start_unless_stopped(self.start(), self._stop_requested, "worker")
        except BaseException:
            await self.close()  # whatever started (the engine process, consumers) stops too
            raise
        if not started:
            await self.close()
            return
        try:
            waiter = asyncio.create_task(self._stop_requested.wait())
            done, _ = await asyncio.wait([waiter, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            for t in done:
                if t is not waiter and t.exception() is not None:
                    self._crash = t.exception()
                    self.health.stopped_by(self._crash)
                    log.error("worker task failed; stopping (unfinished jobs will be redelivered)",
                              task=t.get_name(), error=repr(t.exception())[:300])
            if self._crash is None:
                await self.drain()
        finally:
            await self.close()
        if self._crash is not None:
            raise self._crash

    def dump_tasks(self) -> None:
        """SIGUSR1: log where every asyncio task is waiting (for diagnosing a stuck worker)."""
        for name, frames in task_stacks().items():
            log.warning("task stack", task=name, frames=frames)

    async def drain(self) -> None:
        """Stop taking jobs; let running ones finish until the deadline; hand back the rest."""
        self.draining = True
        deadline = time.monotonic() + self.cfg.worker.drain_timeout_s
        log.info("draining", running=len(self.table), deadline_s=self.cfg.worker.drain_timeout_s)
        while (len(self.table) or self.finalizer.num_forwarding) and time.monotonic() < deadline and not self._crash:
            await asyncio.sleep(0.05)
        handed = [held for held in (self.table.hand_back(j.job_id) for j in self.table.running()) if held is not None]
        for held in handed:
            self.engine.abort(held.job_id)
            self.metrics.aborted.labels("handed_back").inc()
        if handed:
            await stop_within("drain: release the claims of handed-back jobs",
                              self.claims.release([(j.job_id, j.claim_token, j.attempt) for j in handed]), 5)
            log.info("handed back unfinished jobs", job_ids=[held.job_id for held in handed], count=len(handed))
        await self.finalizer.give_back_forwards(self.claims)
        await self.publisher.flush(timeout_s=5)
        deadline = time.monotonic() + 10
        while any(j.state == JobState.FINISHING for j in self.table) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Stop every component; each step is bounded (`worker.obs.stopping`), and a Kafka
        client is closed even when its own stop fails (`security.kafka.stop_client`)."""
        self._stopping.set()
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=10)
            if pending:  # a task that swallowed its cancellation: closing anyway
                log.warning("tasks did not stop within 10 s", tasks=sorted(t.get_name() for t in pending))
        if self.starter is not None:
            self.starter.close()
        if self.intake is not None:  # Kafka away: the next owner re-reads from the last commit
            await stop_within("worker: final offset commit", self.intake.commit(), 10)
        for name, client in (("intake", self.intake and self.intake.consumer),
                             ("cancels", self.cancels and self.cancels.consumer), ("producer", self.producer)):
            if client is not None:
                await stop_client(client, name)
        if self.engine is not None:  # its own joins are bounded (about 20 s)
            await stop_within("worker: engine", asyncio.to_thread(self.engine.stop), 30)
        if self.quota is not None:  # its fleet slots free now, not after their lease
            await stop_within("worker: fleet limits' release", self._release_quota(), 5)
        if self.redis is not None:
            await stop_within("worker: Redis connections", self.redis.aclose(), 5)
        if self.server is not None:
            await stop_within("worker: HTTP endpoint", self.server.stop(), 10)
        if self.tracing.enabled:
            await stop_within("worker: trace export", asyncio.to_thread(self.tracing.shutdown), 10)
        log.info("worker stopped", worker_id=self.worker_id, finished=self.num_finished)

    @property
    def num_finished(self) -> int:
        """Jobs this worker ended (terminal event published and recorded)."""
        return self.finalizer.num_finished if self.finalizer is not None else 0

    # ---- engine outputs → drafts → Redis → recorded ------------------------------------
    def _on_step(self, outputs: list[RequestOutput]) -> None:
        m = self.metrics
        applied = self.table.apply_outputs(outputs)
        for held in applied.first_tokens:
            m.ttft.labels(held.priority).observe(held.first_token_time - held.enqueue_time,
                                                 held.trace.exemplar if held.trace is not None else None)
        if applied.num_tokens:
            m.generation_tokens.inc(applied.num_tokens)
            for tenant, n in applied.tokens_by_tenant.items():
                m.observe_tenant_tokens(tenant, "generation", n)
        self.publisher.wake()

    def _on_published(self, rnd: Round) -> None:
        self.metrics.events_published.inc(len(rnd.events))
        self.metrics.publish_round.observe(self.publisher.last_round_s)
        self.finalizer.add(rnd.finished)

    # ---- the job starter's host (starter.StarterHost) ----------------------------------
    def wake(self) -> None:
        """New drafts or new engine work: the publisher and the engine loop look now."""
        self.publisher.wake()
        if self.engine is not None:
            self.engine.wake()

    def _on_crash(self, exc: BaseException) -> None:
        self._crash = exc
        self.request_stop()

    # ---- cancels, claims, Redis health --------------------------------------------------
    async def cancel(self, job_id: str, headers: tuple = ()) -> None:
        """A cancel message: tombstone (a job not here yet is dropped on arrival) and, if
        the job runs here, abort it (KV freed at the next step boundary). `headers`: the
        cancel record's Kafka headers (its trace context is linked from the job's trace)."""
        self.metrics.cancels.inc()
        try:
            await self.claims.tombstone(job_id)
        except REDIS_DOWN as e:
            log.warning("could not set the cancel tombstone (Redis unreachable)", job_id=job_id, error=repr(e)[:200])
        held = self.table.request_cancel(job_id)
        if held is not None and held.trace is not None:
            held.trace.cancel_requested(headers)
        if held is not None and held.state == JobState.IN_ENGINE:
            self.engine.abort(job_id)

    # ---- the leases' host (leases.LeaseHost) -------------------------------------------
    def abort_in_engine(self, job_id: str) -> None:
        self.engine.abort(job_id)

    def retake(self, records: list[JobRecord]) -> None:
        self.intake.add_contested(records)

    def _on_redis_outage(self, down: bool) -> None:
        self.metrics.redis_outage.set(1 if down else 0)

    def _on_restored(self) -> None:
        self.metrics.redis_restores.inc()  # tombstones lost with it: the cancel index still answers

    def intake_paused(self) -> bool:
        """Draining, stopping, Redis down, or the cancel topic not read up to its end yet:
        intake takes nothing."""
        return (self.draining or self._stop_requested.is_set() or self.publisher.in_outage
                or self.cancels is None or not self.cancels.caught_up.is_set())

    async def restore_redis(self, stale_epoch: str) -> None:
        """Redis lost its data: the publisher re-claims and re-appends (`Publisher.restore`)."""
        await self.publisher.restore(stale_epoch)
