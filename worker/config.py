"""Configuration Structs and their validation.

Every setting is a typed `msgspec.Struct` field. Values are checked in
`__post_init__`, and errors name the field and the allowed values, e.g.
`serving_tuning.kv_policy must be one of ['optimistic', 'reserve'], got 'greedy'`.
"""

from __future__ import annotations

import re

import msgspec

KV_POLICIES = ("optimistic", "reserve")
OVERLOAD_POLICIES = ("queue_or_reject", "reject")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _positive(section: str, **fields: int | None) -> None:
    for name, value in fields.items():
        if value is not None and value < 1:
            raise ConfigError(f"{section}.{name} must be >= 1, got {value}")


def _one_of(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{name} must be one of {sorted(allowed)}, got {value!r}")


def _unused(section: str, why: str, **fields: object) -> None:
    """Settings that would be silently ignored are errors (secrets excepted: a platform
    may inject them into every environment)."""
    for name, value in fields.items():
        if value is not None:
            raise ConfigError(f"{section}.{name} is set but unused with {why}")


def _one_secret(section: str, name: str, value: str | None, path: str | None) -> None:
    if value is not None and path is not None:
        raise ConfigError(f"{section}.{name} and {section}.{name}_file are both set; set one")


def _tls_fields(section: str, uses_tls: bool, why: str, cfg: object) -> None:
    """Checks the ssl_* fields common to the kafka and redis sections."""
    names = ("ssl_cafile", "ssl_certfile", "ssl_keyfile")  # secrets may be injected everywhere: not checked
    if not uses_tls:
        _unused(section, why, **{n: getattr(cfg, n) for n in names})
        return
    _one_secret(section, "ssl_key_password", cfg.ssl_key_password, cfg.ssl_key_password_file)
    if cfg.ssl_keyfile is not None and cfg.ssl_certfile is None:
        raise ConfigError(f"{section}.ssl_keyfile is set without {section}.ssl_certfile (the client certificate)")
    if (cfg.ssl_key_password is not None or cfg.ssl_key_password_file is not None) and cfg.ssl_certfile is None:
        raise ConfigError(f"{section}.ssl_key_password is set without {section}.ssl_certfile (the client certificate)")


def read_secret(field: str, value: str | None, path: str | None) -> str | None:
    """A secret from its file (the first line, without the line break) or its value.

    Args:
        field: `<section>.<name>` for the error message (the file field is `<field>_file`).

    Raises:
        ConfigError: the file cannot be read; the message names `<field>_file` and the
            path, never the content.
    """
    if path is None:
        return value
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\r\n")
    except OSError as e:
        raise ConfigError(f"{field}_file: cannot read {path!r} ({e.strerror})") from None


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***`."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class TenantPolicy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What one tenant gets inside the engine (validated by ServingTuning, which names
    the field: `serving_tuning.tenants['acme'].weight`).

    Attributes:
        weight: its share of service relative to other tenants of the same priority
            class (2 = twice the tokens of a weight-1 tenant while both are backlogged).
        max_running_requests: most of its requests in the running batch at once (all
            classes); more wait, they are not rejected. None: no cap.
        max_kv_blocks: most KV blocks its running requests hold together (block-table
            entries; a prefix block shared by two of its requests counts twice). A
            request that would pass it waits; a running one that needs a block beyond
            it preempts the tenant's own latest request (or itself). A request whose
            prompt + max_tokens can never fit it is rejected (`exceeds_kv_capacity`).
            None: no cap.
    """

    weight: float = 1.0
    max_running_requests: int | None = None
    max_kv_blocks: int | None = None


class ServingTuning(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Capacity limits of one engine (DESIGN §5), in the vocabulary of TGI / TensorRT-LLM.

    Attributes:
        max_running_requests: most requests in the running batch at once.
        max_total_tokens: KV cache capacity in tokens (rounded down to whole blocks).
            None: derived from free GPU memory on CUDA, 16384 on CPU.
        max_input_tokens: longest prompt accepted, in tokens.
        max_output_tokens: most tokens one request may generate (default for
            requests without `max_tokens`, and an upper bound for those with it).
        max_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        admission_control: reject at once requests that can never fit.
        overload_policy: `queue_or_reject` queues what fits later; `reject` also
            rejects requests that cannot start now (used by the worker).
        kv_policy: `optimistic` admits when the prompt fits and preempts by recompute
            when blocks run out (vLLM); `reserve` admits only when prompt + max_tokens
            fit and never evicts (TensorRT-LLM GUARANTEED_NO_EVICT, TGI).
        kv_block_size: tokens per KV block.
        enable_prefix_caching: share full KV blocks between equal prefixes.
        priority_aging_steps: a waiting request gains one priority class per this
            many engine steps, so low priority never starves.
        max_admission_skips: how many requests of its rank may be admitted ahead of a
            waiting request that cannot get its KV blocks (bounded skipping); after
            that it holds a reservation and nothing ranked behind it is admitted
            until it is. 0: strict head-of-line order.
        gpu_memory_utilization: fraction of free GPU memory given to the KV cache
            when `max_total_tokens` is unset.
        max_oom_retries: times a request whose step ran out of GPU memory is
            recomputed before it ends with `finished(error)`, code `oom` (0: fail at once).
        fair_share: inside a priority class, serve tenants by least service received
            (Virtual Token Counter, Sheng et al., OSDI 2024; rules in
            `worker/engine/fair_share.py`); False: arrival order, as without tenants.
        fair_prefill_weight, fair_decode_weight: service of one prompt token computed
            and of one output token, in the counters (VTC's w_p = 1, w_q = 2).
        tenants: per-tenant weight and quotas, by the job's `tenant`; tenants not
            listed get `default_tenant`. Jobs without a tenant are the tenant `""`.
    """

    max_running_requests: int = 64
    max_total_tokens: int | None = None
    max_input_tokens: int = 8192
    max_output_tokens: int = 1024
    max_batched_tokens: int = 2048
    admission_control: bool = True
    overload_policy: str = "queue_or_reject"
    kv_policy: str = "optimistic"
    kv_block_size: int = 16
    enable_prefix_caching: bool = True
    priority_aging_steps: int = 512
    max_admission_skips: int = 8
    gpu_memory_utilization: float = 0.85
    max_oom_retries: int = 1
    fair_share: bool = True
    fair_prefill_weight: float = 1.0
    fair_decode_weight: float = 2.0
    tenants: dict[str, TenantPolicy] = msgspec.field(default_factory=dict)
    default_tenant: TenantPolicy = msgspec.field(default_factory=TenantPolicy)

    def tenant_policy(self, tenant: str) -> TenantPolicy:
        """The weight and quotas of `tenant` (`default_tenant` if it is not listed)."""
        return self.tenants.get(tenant, self.default_tenant)

    def __post_init__(self) -> None:
        _positive(
            "serving_tuning",
            max_running_requests=self.max_running_requests,
            max_total_tokens=self.max_total_tokens,
            max_input_tokens=self.max_input_tokens,
            max_output_tokens=self.max_output_tokens,
            max_batched_tokens=self.max_batched_tokens,
            kv_block_size=self.kv_block_size,
            priority_aging_steps=self.priority_aging_steps,
        )
        _one_of("serving_tuning", "kv_policy", self.kv_policy, KV_POLICIES)
        _one_of("serving_tuning", "overload_policy", self.overload_policy, OVERLOAD_POLICIES)
        for name in ("max_oom_retries", "max_admission_skips"):
            if getattr(self, name) < 0:
                raise ConfigError(f"serving_tuning.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"serving_tuning.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < self.kv_block_size:
            raise ConfigError(
                f"serving_tuning.max_total_tokens ({self.max_total_tokens}) must hold at least one "
                f"KV block of kv_block_size={self.kv_block_size} tokens"
            )
        if not self.fair_prefill_weight >= 0:
            raise ConfigError(f"serving_tuning.fair_prefill_weight must be >= 0, got {self.fair_prefill_weight}")
        if not self.fair_decode_weight > 0:
            raise ConfigError(f"serving_tuning.fair_decode_weight must be > 0, got {self.fair_decode_weight}")
        _check_tenant("serving_tuning.default_tenant", self.default_tenant)
        for name, policy in self.tenants.items():
            _check_tenant(f"serving_tuning.tenants[{name!r}]", policy)


def _check_tenant(where: str, policy: TenantPolicy) -> None:
    if not (policy.weight > 0 and policy.weight < float("inf")):
        raise ConfigError(f"{where}.weight must be > 0 and finite, got {policy.weight}")
    for name in ("max_running_requests", "max_kv_blocks"):
        value = getattr(policy, name)
        if value is not None and value < 1:
            raise ConfigError(f"{where}.{name} must be >= 1 or null, got {value}")


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which checkpoint to load and where.

    Attributes:
        path: local Hugging Face checkpoint directory (config.json, weights, tokenizer).
        dtype: `auto` = bfloat16 on CUDA, float32 on CPU.
        device: `auto` = cuda if available, else cpu.
        attention_backend: `auto` = Triton on CUDA, the torch reference on CPU.
        max_model_len: context length; None = the model config's
            `max_position_embeddings` (capped by a sliding window if the model has one).
    """

    path: str = ""
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _one_of("model", "dtype", self.dtype, DTYPES)
        _one_of("model", "attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"model.device must be one of ['auto', 'cpu', 'cuda', 'cuda:N'], got {self.device!r}")
        _positive("model", max_model_len=self.max_model_len)


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything the engine needs: the model and its capacity limits."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    serving_tuning: ServingTuning = msgspec.field(default_factory=ServingTuning)


class KafkaConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Kafka connection and consumer-group settings.

    Security (see the README's "Security"): `security_protocol` PLAINTEXT | SSL |
    SASL_PLAINTEXT | SASL_SSL. SASL needs `sasl_mechanism` (PLAIN, SCRAM-SHA-256,
    SCRAM-SHA-512), `sasl_username` and a password; TLS verifies the broker against
    `ssl_cafile` (the system's CAs when unset) and presents a client certificate when
    `ssl_certfile` is set (mutual TLS; `ssl_keyfile` if the key is in another file). Every
    secret (`sasl_password`, `ssl_key_password`) comes from the environment
    (`INFLIGHT_KAFKA__SASL_PASSWORD`) or from its `*_file` twin, and is never logged.
    """

    bootstrap_servers: str = "127.0.0.1:19092"
    topic_prefix: str = "inflight"
    group_id: str = "inflight-workers"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = msgspec.field(default=None)
    sasl_password_file: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_key_password: str | None = None
    ssl_key_password_file: str | None = None
    ssl_check_hostname: bool = True
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    max_partition_fetch_bytes: int = 16 * 1024 * 1024
    commit_interval_ms: int = 500
    cancel_lookback_s: float = 600.0
    stall_timeout_s: float = 10.0  # lag, free slots, no record for this long: recreate the consumer
    # Expected transient conditions (coordinator loading, rebalance, broker restart) log at
    # info until one has lasted this long (seconds), then once at warning (worker.transient_log).
    transient_grace_s: float = 30.0

    def __post_init__(self) -> None:
        _positive("kafka", session_timeout_ms=self.session_timeout_ms, max_poll_interval_ms=self.max_poll_interval_ms,
                  commit_interval_ms=self.commit_interval_ms, heartbeat_interval_ms=self.heartbeat_interval_ms,
                  max_partition_fetch_bytes=self.max_partition_fetch_bytes)
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ConfigError(
                f"kafka.heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below kafka.session_timeout_ms "
                f"({self.session_timeout_ms}); Kafka recommends at most a third of it"
            )
        if self.stall_timeout_s <= 0 or self.cancel_lookback_s < 0:
            raise ConfigError("kafka.stall_timeout_s must be > 0 and kafka.cancel_lookback_s >= 0")
        if self.transient_grace_s <= 0:
            raise ConfigError(f"kafka.transient_grace_s must be > 0, got {self.transient_grace_s}")
        if not self.bootstrap_servers:
            raise ConfigError("kafka.bootstrap_servers must not be empty")
        _one_of("kafka", "security_protocol", self.security_protocol, SECURITY_PROTOCOLS)
        uses_sasl = self.security_protocol.startswith("SASL_")
        if uses_sasl:
            if self.sasl_mechanism is None:
                raise ConfigError(f"kafka.sasl_mechanism is required with security_protocol "
                                  f"{self.security_protocol} (one of {sorted(SASL_MECHANISMS)})")
            _one_of("kafka", "sasl_mechanism", self.sasl_mechanism, SASL_MECHANISMS)
            if not self.sasl_username:
                raise ConfigError(f"kafka.sasl_username is required with security_protocol {self.security_protocol}")
            if self.sasl_password is None and self.sasl_password_file is None:
                raise ConfigError(f"kafka.sasl_password (e.g. INFLIGHT_KAFKA__SASL_PASSWORD) or "
                                  f"kafka.sasl_password_file is required with security_protocol {self.security_protocol}")
        else:
            _unused("kafka", f"security_protocol {self.security_protocol} (no SASL)", sasl_mechanism=self.sasl_mechanism,
                    sasl_username=self.sasl_username)
        _one_secret("kafka", "sasl_password", self.sasl_password, self.sasl_password_file)
        _tls_fields("kafka", self.security_protocol in ("SSL", "SASL_SSL"), f"security_protocol {self.security_protocol}",
                    self)

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def password(self) -> str | None:
        """The SASL password: `sasl_password_file`'s first line, else `sasl_password`.

        Raises:
            ConfigError: the file cannot be read (names `kafka.sasl_password_file`).
        """
        return read_secret("kafka.sasl_password", self.sasl_password, self.sasl_password_file)

    def key_password(self) -> str | None:
        """The client key's password: `ssl_key_password_file`'s first line, else
        `ssl_key_password` (None: the key is not encrypted)."""
        return read_secret("kafka.ssl_key_password", self.ssl_key_password, self.ssl_key_password_file)

    def principal(self) -> str:
        """Who the broker will think we are, for error messages: the SASL user, the
        client certificate, or ANONYMOUS."""
        if self.security_protocol.startswith("SASL_"):
            return f"User:{self.sasl_username} ({self.sasl_mechanism})"
        if self.ssl_certfile:
            return f"the client certificate {self.ssl_certfile!r}"
        return "User:ANONYMOUS"

    def __repr__(self) -> str:  # never print secrets
        return (f"KafkaConfig(bootstrap_servers={self.bootstrap_servers!r}, group_id={self.group_id!r}, "
                f"security_protocol={self.security_protocol!r}, ...)")


class RedisConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Redis connection (`redis://`, `rediss://` for TLS, or `unix://` URL) and event
    retention.

    Security: an ACL user with `username` and `password` (or `password_file`), or
    credentials in the URL (given through `INFLIGHT_REDIS__URL`), not both. With
    `rediss://` the server is verified against `ssl_cafile` (the system's CAs when unset)
    and `ssl_certfile` / `ssl_keyfile` are presented when set (for `tls-auth-clients
    yes`). Secrets come from the environment or their `*_file` twins, never logged.

    Attributes:
        log_ttl_s: lifetime of a job's replay log, done mark and counters after its
            last event, seconds.
        log_maxlen: approximate cap of entries per replay log.
        claim_lease_ms: claim lease; renewed every third of it while the job runs.
        tombstone_ttl_s: lifetime of a cancel tombstone, seconds.
        outage_limit_s: how long the worker holds events while Redis is unreachable
            (jobs keep running, intake pauses) before it gives up and exits so its
            partitions move, seconds.
        publish_interval_ms: least time between two publisher rounds; > 0 merges each
            job's tokens of several steps into one event (fewer Redis writes, coarser
            streaming, as vLLM's `stream_interval`); 0 publishes as fast as Redis takes it.
    """

    url: str = "redis://127.0.0.1:6390/0"
    key_prefix: str = "inflight"
    username: str | None = None
    password: str | None = None
    password_file: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_key_password: str | None = None
    ssl_key_password_file: str | None = None
    ssl_check_hostname: bool = True
    log_ttl_s: int = 3600
    log_maxlen: int = 10_000
    claim_lease_ms: int = 15_000
    tombstone_ttl_s: int = 3600
    outage_limit_s: float = 60.0
    publish_interval_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis.url must start with redis://, rediss:// or unix://, got {self.url.split('@')[-1]!r}")
        _positive("redis", log_ttl_s=self.log_ttl_s, log_maxlen=self.log_maxlen, claim_lease_ms=self.claim_lease_ms,
                  tombstone_ttl_s=self.tombstone_ttl_s)
        if not self.outage_limit_s > 0:
            raise ConfigError(f"redis.outage_limit_s must be > 0, got {self.outage_limit_s}")
        if not 0 <= self.publish_interval_ms <= 10_000:
            raise ConfigError(f"redis.publish_interval_ms must be in [0, 10000], got {self.publish_interval_ms}")
        _one_secret("redis", "password", self.password, self.password_file)
        from urllib.parse import urlsplit

        in_url = urlsplit(self.url)
        if (self.password is not None or self.password_file is not None) and in_url.password:
            raise ConfigError("redis.password / redis.password_file and a password in redis.url are both set; "
                              "set one")
        if self.username and in_url.username:
            raise ConfigError("redis.username and a user name in redis.url are both set; set one")
        _tls_fields("redis", self.uses_tls, "a redis:// or unix:// URL (TLS needs rediss://)", self)

    @property
    def uses_tls(self) -> bool:
        return self.url.startswith("rediss://")

    def secret_password(self) -> str | None:
        """The ACL password: `password_file`'s first line, else `password` (None: the
        URL's, or none)."""
        return read_secret("redis.password", self.password, self.password_file)

    def key_password(self) -> str | None:
        """The client key's password (None: the key is not encrypted)."""
        return read_secret("redis.ssl_key_password", self.ssl_key_password, self.ssl_key_password_file)

    def user(self) -> str:
        """The ACL user connections authenticate as, for error messages."""
        from urllib.parse import unquote, urlsplit

        name = self.username or unquote(urlsplit(self.url).username or "")
        return name or "default"

    def safe_url(self) -> str:
        """`url` with its password replaced by `***` (for logs and messages)."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        return f"RedisConfig(url=<hidden>, key_prefix={self.key_prefix!r})"


class WorkerSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Worker identity and lifecycle.

    Attributes:
        worker_id: unique per process; default hostname-pid.
        max_local_jobs: jobs held in this process (running + waiting in the engine +
            being claimed); beyond it partitions are paused so the rest stays in Kafka
            for other workers. Default 2 x max_running_requests.
        drain_timeout_s: on SIGTERM, how long running jobs may finish before they are
            handed back (offsets left uncommitted, claims released).
        max_job_failures: a job whose earlier attempts died this many times (a worker
            crashed running it) is not run again: `finished(error)`, code `poison`, and
            the record goes to the DLQ.
        tokenizer_threads: threads that tokenize prompts and render chat templates, off
            the event loop.
        engine_process: run the engine core (model, KV cache, scheduler) in its own
            process, so the worker's I/O never shares a GIL with the step loop (as vLLM
            V1); false steps it in a thread of the worker process.
        log_level: log level of the engine core process.
        high_priority_reserve: local slots that only high-priority jobs may take, so an
            interactive job finds a slot at once while a batch of lower-priority jobs fills
            the rest (the engine then admits it ahead of them). Default
            (max_local_jobs - max_running_requests) // 4, at least 1; 0 disables it.
        max_local_jobs_per_tenant: most of `max_local_jobs` one tenant holds; the rest
            stays open for other tenants, so a tenant that appears behind a flooding one
            starts without waiting for one of the flood's jobs to end. Default
            max_local_jobs - max_running_requests // 2 (at least 1).
        read_ahead_per_partition: fetched records not yet taken kept per partition,
            among which free slots are given by priority, then tenant share; a partition
            is paused while it has this many (the rest stays in Kafka).
        read_ahead_bytes: bound on the bytes of all those records together; reaching
            it pauses every partition until records are taken.
    """

    worker_id: str | None = None
    max_local_jobs: int | None = None
    drain_timeout_s: float = 30.0
    max_job_failures: int = 2
    tokenizer_threads: int = 2
    engine_process: bool = True
    log_level: str = "INFO"
    high_priority_reserve: int | None = None
    max_local_jobs_per_tenant: int | None = None
    read_ahead_per_partition: int = 512
    read_ahead_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        _positive("worker", max_local_jobs=self.max_local_jobs, max_job_failures=self.max_job_failures,
                  tokenizer_threads=self.tokenizer_threads, max_local_jobs_per_tenant=self.max_local_jobs_per_tenant,
                  read_ahead_per_partition=self.read_ahead_per_partition, read_ahead_bytes=self.read_ahead_bytes)
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


class WorkerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The whole worker configuration file (YAML)."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    serving_tuning: ServingTuning = msgspec.field(default_factory=ServingTuning)
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    worker: WorkerSettings = msgspec.field(default_factory=WorkerSettings)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(model=self.model, serving_tuning=self.serving_tuning)


ENV_PREFIX = "INFLIGHT_"


SECRET_FIELDS = {"kafka": ("sasl_password", "ssl_key_password"), "redis": ("password", "ssl_key_password")}


def redacted_config(cfg: WorkerConfig) -> dict:
    """The config as plain data for logs, with every secret replaced by `***`
    (`SECRET_FIELDS` and the password in `redis.url`; the `*_file` paths are kept)."""
    data = msgspec.to_builtins(cfg)
    for section, names in SECRET_FIELDS.items():
        for name in names:
            if data[section].get(name) is not None:
                data[section][name] = "***"
    data["redis"]["url"] = redact_url(cfg.redis.url)
    return data


def load_config(path: str | None = None, env: dict[str, str] | None = None, *, root: type = WorkerConfig):
    """Read a YAML file (optional) and apply `INFLIGHT_<SECTION>__<FIELD>` environment
    overrides, e.g. `INFLIGHT_KAFKA__BOOTSTRAP_SERVERS`. A value for a string field is
    taken as is (passwords may hold any character); other fields parse it as a YAML
    scalar (`64`, `0.5`, `true`, `null`, `[a, b]`); an empty value means null.

    `root`: the Struct of the whole file (default `WorkerConfig`; the gateway has its
    own, `worker.gateway.config.GatewayFileConfig`); its fields are the sections.

    Raises:
        ConfigError: unreadable file, unknown section/field, wrong type, invalid value;
            the message names the field.
    """
    import os

    import yaml

    data: dict = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
        except yaml.YAMLError as e:  # position only: the text may hold a secret
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"config file {path!r} is not valid YAML{where}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections")
    for key, raw in (env if env is not None else os.environ).items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        section, _, field = key[len(ENV_PREFIX) :].lower().partition("__")
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        data[section][field] = _env_value(key, section, field, raw, root)
    try:
        return msgspec.convert(data, root)
    except msgspec.ValidationError as e:
        msg = str(e)
        if msg.startswith(tuple(f"{f.name}." for f in msgspec.structs.fields(root))):
            raise ConfigError(msg.split(" - at ")[0]) from None  # raised by our own checks
        raise ConfigError(f"invalid config: {msg}") from None


def _field_type(section: str, field: str, root: type = WorkerConfig):
    """The annotated type of `<section>.<field>` of `root`, or None if unknown."""
    sections = {f.name: f.type for f in msgspec.structs.fields(root)}
    sect = sections.get(section)
    if sect is None:
        return None
    return {f.name: f.type for f in msgspec.structs.fields(sect)}.get(field)


def _env_value(key: str, section: str, field: str, raw: str, root: type = WorkerConfig):
    import types
    import typing

    import yaml

    if raw == "":
        return None
    typ = _field_type(section, field, root)
    if typ is str or (typing.get_origin(typ) in (typing.Union, types.UnionType)
                      and str in typing.get_args(typ)):
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:  # never echo the value: it may be a secret
        raise ConfigError(f"{section}.{field}: the value of {key} is not a valid scalar") from None
