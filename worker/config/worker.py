"""Worker-process settings (`WorkerSettings`: local job bound, engine process, publish
interval, poison-job limit), the metrics endpoint (`MetricsConfig`) and the whole file
(`WorkerConfig`), whose fields are the YAML file's sections."""

from __future__ import annotations

import msgspec

from schemas.pools import DEFAULT_POOL, Pool, Pools
from worker.config.checks import LOG_LEVELS, ConfigError, one_of, positive
from worker.config.engine import EngineConfig, ModelConfig, ServingTuning
from worker.config.services import KafkaConfig, RedisConfig


class WorkerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Worker identity and lifecycle.

    Attributes:
        worker_id: unique per process; default hostname-pid.
        max_local_jobs: jobs held in this process before their terminal event (running +
            waiting in the engine + being claimed); beyond it partitions are paused so the
            rest stays in Kafka for other workers. Jobs whose terminal event is being
            written do not count (at most as many again). Default 2 x max_running_requests.
        drain_timeout_s: on SIGTERM, how long running jobs may finish before they are
            handed back (offsets left uncommitted, claims released).
        max_job_failures: a job whose earlier attempts died this many times (a worker
            crashed running it) is not run again: `finished(error)`, code `poison`, and
            the record goes to the DLQ.
        poison_grace_s: how long a job at `max_job_failures` waits before it is called
            poison, seconds: a worker that stalled (paused, swapped out, frozen) past its
            claim lease looks dead until it comes back; when it does, it clears the mark
            its attempt left, and the job runs (alone) instead. 0: at once.
        tokenizer_threads: threads that tokenize prompts and render chat templates, off
            the event loop.
        engine_process: run the engine core (model, KV cache, scheduler) in its own
            process, so the worker's I/O never shares a GIL with the step loop (as vLLM
            V1); false steps it in a thread of the worker process.
        engine_threads: torch intra-op threads of the engine; default (None) sized from
            the CPUs this process may use (affinity, cgroup quota) less one for the
            worker's event loop, divided among the engines on the host and followed as
            they come and go (`worker.engine.threads`).
        log_level: log level of the worker's processes (its own and its engine core's):
            DEBUG, INFO, WARNING, ERROR or CRITICAL (any case); `inflight worker
            --log-level` overrides it.
        high_priority_reserve: local slots that only high-priority jobs may take, so an
            interactive job finds a slot at once while a batch of lower-priority jobs fills
            the rest (the engine then admits it ahead of them). Taken only from the
            slots beyond the running batch, so lower classes can always fill the batch:
            at most max_local_jobs - max_running_requests. Default a quarter of those
            (at least 1 when there are any); 0 disables it.
        max_local_jobs_per_tenant: most of `max_local_jobs` one tenant holds; the rest
            stays open for other tenants, so a tenant that appears behind a flooding one
            starts without waiting for one of the flood's jobs to end. Default
            max_local_jobs - high_priority_reserve - max_running_requests // 2 (at
            least 1): half a running batch of normal-class slots stays open.
        read_ahead_per_partition: fetched records not yet taken kept per partition,
            among which free slots are given by priority, then tenant share; beyond it a
            partition's records stay in the consumer's fetch buffer (at most one fetch
            response, `kafka.max_partition_fetch_bytes`) or in Kafka.
        read_ahead_bytes: bound on the bytes of all those records together; reaching
            it pauses every partition until records are taken.
        pool: the pool this worker serves (`pools`, schemas/pools.py): it reads that
            pool's job topics in that pool's consumer group and forwards a job whose
            prompt is outside the pool's range to the pool that serves it.
    """

    worker_id: str | None = None
    pool: str = DEFAULT_POOL
    max_local_jobs: int | None = None
    drain_timeout_s: float = 30.0
    max_job_failures: int = 2
    poison_grace_s: float = 60.0
    tokenizer_threads: int = 2
    engine_process: bool = True
    engine_threads: int | None = None
    log_level: str = "INFO"
    high_priority_reserve: int | None = None
    max_local_jobs_per_tenant: int | None = None
    read_ahead_per_partition: int = 512
    read_ahead_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        self.log_level = self.log_level.upper()
        one_of("worker", "log_level", self.log_level, LOG_LEVELS)
        positive("worker", max_local_jobs=self.max_local_jobs, max_job_failures=self.max_job_failures,
                  tokenizer_threads=self.tokenizer_threads, engine_threads=self.engine_threads,
                  max_local_jobs_per_tenant=self.max_local_jobs_per_tenant,
                  read_ahead_per_partition=self.read_ahead_per_partition, read_ahead_bytes=self.read_ahead_bytes)
        if not 0 <= self.poison_grace_s <= 86_400:
            raise ConfigError(f"worker.poison_grace_s must be in [0, 86400], got {self.poison_grace_s}")
        if self.high_priority_reserve is not None and self.high_priority_reserve < 0:
            raise ConfigError(f"worker.high_priority_reserve must be >= 0, got {self.high_priority_reserve}")
        if (self.max_local_jobs is not None and self.high_priority_reserve is not None
                and self.high_priority_reserve >= self.max_local_jobs):
            raise ConfigError(f"worker.high_priority_reserve ({self.high_priority_reserve}) must be below "
                              f"worker.max_local_jobs ({self.max_local_jobs})")
        if (self.max_local_jobs is not None and self.max_local_jobs_per_tenant is not None
                and self.max_local_jobs_per_tenant > self.max_local_jobs):
            raise ConfigError(f"worker.max_local_jobs_per_tenant ({self.max_local_jobs_per_tenant}) must be <= "
                              f"worker.max_local_jobs ({self.max_local_jobs})")


class MetricsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The worker's HTTP endpoint: `/metrics` (Prometheus), `/healthz`, `/readyz`.

    Attributes:
        port: TCP port; 0 picks a free one (logged); None serves no HTTP at all.
        host: address to bind.
        check_interval_s: how often Kafka and Redis reachability and consumer lag are
            checked (readiness and the lag gauges), seconds.
        check_timeout_s: a reachability check slower than this counts as unreachable.
        engine_stall_s: `/healthz` fails when the engine loop has not ticked for this
            long (a step that hangs), seconds.
        tenant_labels: per-tenant series carry the `tenant` label of at most this many
            tenants (the top ones by tokens served, re-ranked every
            `tenant_rank_interval_s`); the rest are summed under `other` (0: all are).
        tenant_rank_interval_s: how often the labelled tenants are re-ranked, seconds.
    """

    port: int | None = 8000
    host: str = "0.0.0.0"
    check_interval_s: float = 5.0
    check_timeout_s: float = 3.0
    engine_stall_s: float = 120.0
    tenant_labels: int = 10
    tenant_rank_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(f"metrics.port must be in [0, 65535] or null, got {self.port}")
        for name in ("check_interval_s", "check_timeout_s", "engine_stall_s", "tenant_rank_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"metrics.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.tenant_labels <= 1000:
            raise ConfigError(f"metrics.tenant_labels must be in [0, 1000], got {self.tenant_labels}")


TRACING_PROTOCOLS = ("http/protobuf", "http/json", "grpc")
TRACING_EXPORTS = ("process", "thread")


class TracingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenTelemetry traces (`worker.obs.tracing`): one trace per job, from the producer
    or the HTTP request to the last token. Off by default; while off nothing of
    OpenTelemetry is imported. The standard `OTEL_*` environment variables are honoured
    where a field is unset: `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, `_PROTOCOL`,
    `_HEADERS`, `_TIMEOUT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
    `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG`, `OTEL_BSP_*` (the batch processor).

    Attributes:
        enabled: export spans over OTLP.
        endpoint: the collector's OTLP base address, e.g. `http://otel-collector:4318`
            (HTTP; `/v1/traces` is appended) or `http://otel-collector:4317` (gRPC).
            None: the `OTEL_EXPORTER_OTLP_*` variables, else the SDK default
            (localhost, 4318 or 4317).
        protocol: `http/protobuf`, `http/json` (OTLP's JSON encoding, accepted by the
            OpenTelemetry Collector and Jaeger but not by every vendor's endpoint; both
            encoded by Inflight from its span records) or `grpc` (through the SDK's
            exporter: about 10x the encoding cost); None:
            `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`, else `http/protobuf`.
        service_name: `service.name` of the spans when `OTEL_SERVICE_NAME` is unset
            (None: `inflight-worker` / `inflight-gateway`).
        sample_ratio: fraction of new traces sampled (jobs whose producer sent a trace
            context follow its sampled flag: parent-based); None: `OTEL_TRACES_SAMPLER`,
            else every trace.
        capture_content: record prompts and completions as span events. Off: no text of a
            job ever reaches a span.
        export: where spans are encoded and sent: `process` (a child process of the
            worker or gateway, `worker.obs.trace_export`: the encoding and the HTTP or
            gRPC calls take nothing from the serving process's GIL) or `thread` (the
            SDK's batch span processor in the serving process).
    """

    enabled: bool = False
    endpoint: str | None = None
    protocol: str | None = None
    service_name: str | None = None
    sample_ratio: float | None = None
    capture_content: bool = False
    export: str = "process"

    def __post_init__(self) -> None:
        if self.export not in TRACING_EXPORTS:
            raise ConfigError(f"tracing.export must be one of {list(TRACING_EXPORTS)}, got {self.export!r}")
        if self.protocol is not None and self.protocol not in TRACING_PROTOCOLS:
            raise ConfigError(f"tracing.protocol must be one of {list(TRACING_PROTOCOLS)} or null, "
                              f"got {self.protocol!r}")
        if self.sample_ratio is not None and not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError(f"tracing.sample_ratio must be in [0, 1] or null, got {self.sample_ratio}")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"tracing.endpoint must start with http:// or https://, got {self.endpoint!r}")


def pool_set(pools: list[Pool]) -> Pools:
    """The `pools` section as `Pools`.

    Raises:
        ConfigError: the section is invalid (the message names the pool).
    """
    try:
        return Pools(pools)
    except ValueError as e:
        raise ConfigError(f"pools: {e}") from None


class WorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The whole worker configuration file (YAML). `pools`: the fleet's pools by prompt
    length (schemas/pools.py; empty: one pool, `default`, without a bound)."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    serving_tuning: ServingTuning = msgspec.field(default_factory=ServingTuning)
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    worker: WorkerSettings = msgspec.field(default_factory=WorkerSettings)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    pools: list[Pool] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.model.engine == "vllm" and not self.worker.engine_process:
            raise ConfigError("model.engine 'vllm' needs worker.engine_process: true (vLLM runs in its own "
                              "interpreter, model.vllm_python)")
        pools = pool_set(self.pools)
        if self.worker.pool not in pools.names:
            raise ConfigError(f"worker.pool must be one of the declared pools {pools.names}, "
                              f"got {self.worker.pool!r}")

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(model=self.model, serving_tuning=self.serving_tuning)

    @property
    def pool_set(self) -> Pools:
        return Pools(self.pools)  # validated in __post_init__

    @property
    def pool(self) -> Pool:
        """The pool this worker serves."""
        return self.pool_set.get(self.worker.pool)

    @property
    def job_group_id(self) -> str:
        """The consumer group of this worker's pool (`kafka.group_id` for `default`)."""
        return self.pool_set.group_id(self.pool, self.kafka.group_id)
