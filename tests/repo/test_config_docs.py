"""Every field of every configuration section is documented in its class's `Attributes`
(the API reference renders them: docs/api.md), so no setting is known only from examples."""

from __future__ import annotations

import inspect
import re

import pytest

from schemas.pools import Pool
from worker.config.engine import ModelConfig, ServingTuning, TenantPolicy
from worker.config.services import KafkaConfig, RedisConfig
from worker.config.speculative import SpeculativeConfig
from worker.config.worker import MetricsConfig, TracingConfig, WorkerSettings
from worker.gateway.config import ApiKey, GatewayConfig

SECTIONS = [ModelConfig, ServingTuning, SpeculativeConfig, TenantPolicy, KafkaConfig, RedisConfig, WorkerSettings, MetricsConfig,
            TracingConfig, GatewayConfig, ApiKey, Pool]


def documented(cls) -> set[str]:
    """The names an `Attributes:` block of `cls` or a base documents (`a, b: ...` lines)."""
    names: set[str] = set()
    for c in cls.__mro__:
        m = re.search(r"Attributes:\n(.*?)(\n\S|\Z)", inspect.getdoc(c) or "", re.S)
        for line in (m.group(1).splitlines() if m else ()):
            head = re.match(r" {4}(\S[^:]*):", line)
            if head:
                names.update(n.strip().strip("`") for n in head.group(1).split(","))
    return names


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_every_field_is_documented(cls):
    missing = [f for f in cls.__struct_fields__ if f not in documented(cls)]
    assert not missing, f"{cls.__name__}: document {missing} in its Attributes"
