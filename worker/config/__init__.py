"""Configuration Structs and their validation.

Every setting is a typed `msgspec.Struct` field. Values are checked in
`__post_init__`, and errors name the field and the allowed values, e.g.
`serving_tuning.kv_policy must be one of ['optimistic', 'reserve'], got 'greedy'`.

    checks.py    ConfigError and the shared rules (positive, one of, unused, secrets, TLS)
    engine.py    ModelConfig, ServingTuning, TenantPolicy, EngineConfig (no services)
    speculative.py SpeculativeConfig (serving_tuning.speculative)
    services.py  KafkaConfig, RedisConfig
    worker.py    WorkerSettings, MetricsConfig, TracingConfig, WorkerConfig (the whole file)
    load.py      load_config (YAML + INFLIGHT_* overrides), redacted_config
"""

from worker.config.checks import ConfigError, read_secret, redact_url
from worker.config.engine import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_POLICIES,
    OVERLOAD_POLICIES,
    EngineConfig,
    ModelConfig,
    ServingTuning,
    TenantPolicy,
)
from worker.config.load import ENV_PREFIX, SECRET_FIELDS, load_config, redacted_config
from worker.config.services import SASL_MECHANISMS, SECURITY_PROTOCOLS, KafkaConfig, RedisConfig
from worker.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig
from worker.config.worker import TRACING_PROTOCOLS, MetricsConfig, TracingConfig, WorkerConfig, WorkerSettings

__all__ = [
    "ATTENTION_BACKENDS", "DTYPES", "ENV_PREFIX", "KV_POLICIES", "OVERLOAD_POLICIES", "SASL_MECHANISMS",
    "SECRET_FIELDS", "SECURITY_PROTOCOLS", "SPECULATIVE_METHODS", "SpeculativeConfig", "TRACING_PROTOCOLS", "TracingConfig", "ConfigError", "EngineConfig", "KafkaConfig", "MetricsConfig",
    "ModelConfig", "RedisConfig", "ServingTuning", "TenantPolicy", "WorkerConfig", "WorkerSettings",
    "load_config", "read_secret", "redact_url", "redacted_config",
]
