"""The gateway's configuration: its own `gateway` section beside the `kafka` and `redis`
sections a worker uses, loaded by the same loader (YAML file + `INFLIGHT_<SECTION>__<FIELD>`
environment overrides, e.g. `INFLIGHT_GATEWAY__PORT=8080`), validated with errors that
name the field."""

from __future__ import annotations

import re

import msgspec

from schemas import keys, reasoning, tool_parsers
from schemas.pools import Pool
from schemas.wire import ADAPTER_PATTERN, TENANT_PATTERN
from worker.config import ConfigError, KafkaConfig, RedisConfig, TracingConfig, load_config
from worker.config.worker import pool_set

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_adapters(field: str, names: list[str]) -> None:
    for name in names:
        if not re.fullmatch(ADAPTER_PATTERN, name):
            raise ConfigError(f"{field}: {name!r} is not an adapter name (A-Z a-z 0-9 . _ -, at most 128)")
_DURATION = re.compile(r"^(\d+)([smh])$")


class ApiKey(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One API key (a Bearer token) and what it may do.

    Attributes:
        key: the token itself (prefer `key_sha256` in files, or the env / a key file).
        key_sha256: hex SHA-256 of the token instead of the token.
        tenant: the tenant its jobs run as (their Redis keys, prefix-cache salt, the
            tenant's fair share); None: jobs without a tenant.
        max_priority: the highest priority class it may ask for (`high`, `normal`, `low`).
        name: a label for logs (never the key).
        adapters: the LoRA adapters it may use (a tenant's own fine-tunes); others are
            404 and missing from its `GET /v1/models`. None: every adapter served.
    """

    key: str | None = None
    key_sha256: str | None = None
    tenant: str | None = None
    max_priority: str = "normal"
    name: str | None = None
    adapters: list[str] | None = None

    def __post_init__(self) -> None:
        if (self.key is None) == (self.key_sha256 is None):
            raise ConfigError("gateway.api_keys: each key needs exactly one of `key` or `key_sha256`")
        if self.key is not None and len(self.key) < 8:
            raise ConfigError("gateway.api_keys: a key must be at least 8 characters")
        if self.key_sha256 is not None and not _SHA256.match(self.key_sha256):
            raise ConfigError("gateway.api_keys: key_sha256 must be 64 lowercase hex digits")
        if self.tenant is not None and not re.fullmatch(TENANT_PATTERN, self.tenant):
            raise ConfigError(f"gateway.api_keys: tenant {self.tenant!r} is not a valid tenant id "
                              "(A-Z a-z 0-9 . _ @ / + = -, no ':')")
        if self.max_priority not in keys.PRIORITIES:
            raise ConfigError(f"gateway.api_keys: max_priority must be one of {list(keys.PRIORITIES)}, "
                              f"got {self.max_priority!r}")
        check_adapters("gateway.api_keys: adapters", self.adapters or [])

    def __repr__(self) -> str:  # never print the key
        return f"ApiKey(name={self.name!r}, tenant={self.tenant!r}, max_priority={self.max_priority!r})"


class GatewayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The HTTP gateway (`inflight gateway`).

    Attributes:
        host, port: listen address of the API and of /metrics /healthz /readyz.
        model_name: the model id clients name in `model` (`GET /v1/models` lists it).
        adapters: LoRA adapters served as models `<model_name>:<adapter>` (the jobs carry
            `adapter`; workers load it from their `model.lora_dir`).
        lora_dir: also serve every adapter found in this directory (the workers'
            `model.lora_dir`, mounted here too), listed again every 10 s: an adapter
            copied there is served by gateways and workers without a restart.
        tokenizer: a `tokenizer.json` file or a checkpoint directory holding one: logprob
            tokens are shown as text. None: as `token_id:<id>` (vLLM's spelling).
        max_model_len: the model's context in tokens, reported by `GET /v1/models` as
            `max_model_len` (as vLLM does). None: read from `config.json` of the
            `tokenizer` directory (`max_position_embeddings`) when there is one, else not
            reported.
        api_keys: keys and their grants.
        api_keys_file: a YAML list of more entries of the same form, read at start.
        allow_anonymous: requests without an Authorization header run as no tenant with
            `default_priority` at most (development only); unknown keys still get 401.
        default_priority: priority of requests that name none (capped by the key's grant).
        batch_priority: the priority class (topic) batch lines run on.
        queue_timeout_s: how long a job may wait to start; it becomes the job's
            `deadline`, after which the request ends with 429 and `Retry-After`.
        request_timeout_s: longest an interactive request may take in all, seconds.
        retry_after_s: the `Retry-After` of a 429, seconds.
        max_concurrent_requests: interactive requests in flight in this process; more
            get 429 at once.
        max_body_bytes: largest request body of the generation endpoints.
        max_file_bytes: largest upload (`POST /v1/files`).
        max_batch_lines: most lines (requests) in one batch input file.
        files_dir: where uploaded and result files and batch manifests live: a local
            directory; several gateways need one shared directory (NFS, EFS, a
            ReadWriteMany volume) mounted at the same path.
        batch_lease_ms: lease of the gateway driving a batch (renewed every third of it);
            another gateway adopts the batch when it lapses.
        batch_scan_interval_s: how often a gateway looks for batches without a driver.
        batch_cancel_grace_s: how long a cancelling batch waits for the outcomes of its
            dispatched lines before lines still unanswered are written off as cancelled.
        drain_timeout_s: on SIGTERM, how long open requests may finish, seconds.
        no_worker_grace_s: how long a pool may show no live worker (no member of its
            consumer group on its job topics, checked every 5 s) before its requests are
            answered 503 `no_live_worker` at once and, for the default pool, `/readyz`
            turns unready; seconds (covers a worker's group join after a start or a
            rebalance). worker.gateway.liveness.
        tool_parser: how "auto" tool calls are read from the model's text: `auto` (from
            the chat template of `tokenizer`), `none` ("auto" requests get 400), or a
            family: `hermes` (Qwen, Hermes), `llama3_json`, `mistral`.
        reasoning_parser: how reasoning is split from the answer (`reasoning_content`):
            `auto` (from the template), `none`, `deepseek_r1` (the template opens
            `<think>`), `qwen3` (the model opens it). worker.gateway.agents.
        constrained_tool_calls: an "auto" request carries a grammar: a call the model
            opens is held to the tools' JSON Schemas (its text before that is free).
        responses_ttl_s: how long a `/v1/responses` answer stays retrievable and usable as
            `previous_response_id` (in Redis, per tenant), seconds; 0: never stored.
    """

    host: str = "0.0.0.0"
    port: int = 8080
    model_name: str = "inflight"
    adapters: list[str] = []
    lora_dir: str | None = None
    tokenizer: str | None = None
    max_model_len: int | None = None
    api_keys: list[ApiKey] = []
    api_keys_file: str | None = None
    allow_anonymous: bool = False
    default_priority: str = "normal"
    batch_priority: str = "low"
    queue_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    retry_after_s: int = 2
    max_concurrent_requests: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    max_file_bytes: int = 200 * 1024 * 1024
    max_batch_lines: int = 50_000
    files_dir: str = "inflight-files"
    batch_lease_ms: int = 15_000
    batch_scan_interval_s: float = 5.0
    batch_cancel_grace_s: float = 60.0
    drain_timeout_s: float = 30.0
    no_worker_grace_s: float = 5.0
    tool_parser: str = "auto"
    reasoning_parser: str = "auto"
    constrained_tool_calls: bool = True
    responses_ttl_s: int = 3600

    def __post_init__(self) -> None:
        for name, allowed in (("tool_parser", ("auto", "none", *tool_parsers.FAMILIES)),
                              ("reasoning_parser", ("auto", "none", *reasoning.FAMILIES))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"gateway.{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        for name in ("default_priority", "batch_priority"):
            if getattr(self, name) not in keys.PRIORITIES:
                raise ConfigError(f"gateway.{name} must be one of {list(keys.PRIORITIES)}, got {getattr(self, name)!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"gateway.max_model_len must be >= 1 or null, got {self.max_model_len}")
        if not self.no_worker_grace_s >= 0:
            raise ConfigError(f"gateway.no_worker_grace_s must be >= 0, got {self.no_worker_grace_s}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"gateway.port must be in [0, 65535], got {self.port}")
        for name in ("queue_timeout_s", "request_timeout_s", "batch_scan_interval_s", "batch_cancel_grace_s",
                     "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"gateway.{name} must be > 0, got {getattr(self, name)}")
        if self.responses_ttl_s < 0:
            raise ConfigError(f"gateway.responses_ttl_s must be >= 0 (0: not stored), got {self.responses_ttl_s}")
        for name in ("retry_after_s", "max_concurrent_requests", "max_body_bytes", "max_file_bytes",
                     "max_batch_lines", "batch_lease_ms"):
            if getattr(self, name) < 1:
                raise ConfigError(f"gateway.{name} must be >= 1, got {getattr(self, name)}")
        if not self.model_name:
            raise ConfigError("gateway.model_name must not be empty")
        check_adapters("gateway.adapters", self.adapters)
        if not self.files_dir:
            raise ConfigError("gateway.files_dir must not be empty")

    def load_keys(self) -> list[ApiKey]:
        """`api_keys` plus the entries of `api_keys_file`.

        Raises:
            ConfigError: the file cannot be read or holds an invalid entry (names the
                file, never a key).
        """
        found = list(self.api_keys)
        if self.api_keys_file is None:
            return found
        import yaml

        try:
            with open(self.api_keys_file, encoding="utf-8") as f:
                data = yaml.safe_load(f) or []
        except OSError as e:
            raise ConfigError(f"gateway.api_keys_file: cannot read {self.api_keys_file!r} ({e.strerror})") from None
        except yaml.YAMLError:
            raise ConfigError(f"gateway.api_keys_file: {self.api_keys_file!r} is not valid YAML") from None
        if not isinstance(data, list):
            raise ConfigError(f"gateway.api_keys_file: {self.api_keys_file!r} must hold a list of keys")
        try:
            found += msgspec.convert(data, list[ApiKey])
        except msgspec.ValidationError as e:
            raise ConfigError(f"gateway.api_keys_file {self.api_keys_file!r}: {str(e).split(' - at ')[0]}") from None
        return found


class GatewayFileConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The whole gateway config file: `gateway` plus the `kafka` and `redis` connection
    sections (the same fields, security included, as a worker's), `tracing`, and the
    fleet's `pools` (schemas/pools.py: with `gateway.tokenizer` set, each request goes to
    the pool serving its prompt length; without it, to the default pool's topics)."""

    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    pools: list[Pool] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        pool_set(self.pools)


def load_gateway_config(path: str | None = None, env: dict[str, str] | None = None) -> GatewayFileConfig:
    """Read the gateway's YAML file (optional) and its `INFLIGHT_*` overrides.

    Raises:
        ConfigError: unreadable file, unknown section or field, invalid value.
    """
    return load_config(path, env, root=GatewayFileConfig)


def parse_window(window: str) -> float | None:
    """A batch `completion_window` (`24h`, also `90m`, `600s`) in seconds, or None if it
    is not such a duration."""
    m = _DURATION.match(window)
    if not m or int(m.group(1)) == 0:
        return None
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]
