"""Integration tests against the real Kafka and Redis of tools/devstack.sh (started here
if they are not running)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KAFKA = os.environ.get("INFLIGHT_TEST_KAFKA", f"127.0.0.1:{os.environ.get('INFLIGHT_DEV_KAFKA_PORT', '19092')}")
REDIS = os.environ.get("INFLIGHT_TEST_REDIS", f"redis://127.0.0.1:{os.environ.get('INFLIGHT_DEV_REDIS_PORT', '6390')}/0")


def _port_open(hostport: str) -> bool:
    host, port = hostport.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


@pytest.fixture(scope="session")
def services() -> tuple[str, str]:
    redis_port = REDIS.rsplit(":", 1)[1].split("/")[0]
    if not (_port_open(KAFKA) and _port_open(f"127.0.0.1:{redis_port}")):
        subprocess.run([str(ROOT / "tools" / "devstack.sh"), "up"], check=True, cwd=ROOT)
    return KAFKA, REDIS


@pytest.fixture
def prefix(services) -> str:
    """A fresh topic/key prefix per test (topics created with 3 partitions)."""
    from worker.topics import create_topics

    p = f"t{uuid.uuid4().hex[:10]}"
    asyncio.run(create_topics(services[0], p, partitions=3))
    return p


def worker_config(services, prefix: str, **over):
    from worker.config import (
        KafkaConfig,
        MetricsConfig,
        ModelConfig,
        RedisConfig,
        ServingTuning,
        WorkerConfig,
        WorkerSettings,
    )

    tuning = dict(max_running_requests=8, max_total_tokens=4096, max_batched_tokens=256, max_output_tokens=256)
    tuning.update(over.pop("tuning", {}))
    kafka = dict(bootstrap_servers=services[0], topic_prefix=prefix, group_id=f"{prefix}-workers",
                 session_timeout_ms=6000, heartbeat_interval_ms=1000, commit_interval_ms=200)
    kafka.update(over.pop("kafka", {}))
    redis = dict(url=services[1], key_prefix=prefix, claim_lease_ms=3000)
    redis.update(over.pop("redis", {}))
    worker = dict(drain_timeout_s=10.0)
    metrics = dict(port=0, host="127.0.0.1", check_interval_s=0.5, check_timeout_s=2.0)
    metrics.update(over.pop("metrics", {}))
    worker.update(over.pop("worker", {}))
    return WorkerConfig(
        model=ModelConfig(**over.pop("model", {"dtype": "float32", "device": "cpu"})),
        serving_tuning=ServingTuning(**tuning),
        kafka=KafkaConfig(**kafka),
        redis=RedisConfig(**redis),
        worker=WorkerSettings(**worker),
        metrics=MetricsConfig(**metrics),
    )
