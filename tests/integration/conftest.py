"""Integration tests against the real Kafka and Redis of tools/stack/devstack.sh (started here
if they are not running)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
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


@pytest.fixture(autouse=True)
def reap_spawned():
    """Every process a test started through `tests.integration.processes.spawn` is stopped
    (SIGTERM, SIGKILL after 20 s) and reaped when the test ends, passed, failed or timed
    out; the ones still running then are printed (the test's captured output)."""
    from tests.integration.processes import reap

    yield
    for line in reap():
        print("stopped after the test:", line)


@pytest.fixture(scope="session")
def services() -> tuple[str, str]:
    redis_port = REDIS.rsplit(":", 1)[1].split("/")[0]
    if not (_port_open(KAFKA) and _port_open(f"127.0.0.1:{redis_port}")):
        subprocess.run([str(ROOT / "tools" / "stack" / "devstack.sh"), "up"], check=True, cwd=ROOT)
    return KAFKA, REDIS


@pytest.fixture
def prefix(services) -> str:
    """A fresh topic/key prefix per test (topics created with 3 partitions)."""
    from worker.cli.topics import create_topics

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
        TracingConfig,
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
        model=ModelConfig(**{"compile": "off", **over.pop("model", {"dtype": "float32", "device": "cpu"})}),
        serving_tuning=ServingTuning(**tuning),
        kafka=KafkaConfig(**kafka),
        redis=RedisConfig(**redis),
        worker=WorkerSettings(**worker),
        metrics=MetricsConfig(**metrics),
        tracing=TracingConfig(**over.pop("tracing", {})),
        pools=over.pop("pools", []),
    )


class OwnRedis:
    """A redis-server this test starts and stops itself (by its own PID / SHUTDOWN), for
    outages and restarts that must not touch the dev stack other tests share."""

    def __init__(self, workdir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir), "--save", "",
             "--appendonly", "no", "--logfile", str(self.dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if _port_open(f"127.0.0.1:{self.port}"):
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self, keep_data: bool) -> None:
        """SHUTDOWN SAVE (restarts with its data) or NOSAVE (restarts empty)."""
        if not keep_data:
            (self.dir / "dump.rdb").unlink(missing_ok=True)
        subprocess.run(["redis-cli", "-p", str(self.port), "SHUTDOWN", "SAVE" if keep_data else "NOSAVE"],
                       capture_output=True, timeout=30)
        if self.proc is not None:
            self.proc.wait(30)
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
            self.proc.wait()
        self.proc = None


@pytest.fixture
def own_redis(services, tmp_path):
    r = OwnRedis(tmp_path / "own-redis")
    r.start()
    yield r
    r.kill()


# ---- the secured stack (tools/stack/devstack.sh up --secure) -----------------------------------
SECURE_STATE = Path(os.environ.get("INFLIGHT_TEST_SECURE_STATE", ROOT / ".cache" / "devstack-secure"))


class SecureStack:
    """The secured dev stack as its manifest (`stack.json`) describes it: Kafka listeners
    (`sasl_ssl`, `ssl`, `sasl_plaintext`), the TLS-only Redis, certificates, secrets and
    one client config per principal and mode (`configs/<principal>-<mode>.yaml`)."""

    def __init__(self, manifest: dict) -> None:
        self.manifest = manifest
        self.state = Path(manifest["state"])
        self.certs = Path(manifest["certs"])
        self.secrets = Path(manifest["secrets"])
        self.configs = Path(manifest["configs"])
        self.prefix = manifest["prefix"]
        self.group_id = manifest["group_id"]
        self.redis_url = manifest["redis"]

    def config_path(self, principal: str, mode: str) -> Path:
        """`mode`: scram-sha-512, scram-sha-256, plain (SASL_SSL), mtls (SSL), sasl-plaintext."""
        return self.configs / f"inflight-{principal}-{mode}.yaml"

    def sections(self, principal: str, mode: str, **redis_over):
        """(KafkaConfig, RedisConfig) of `principal` in `mode`, Redis fields replaced by `redis_over`."""
        import msgspec

        from worker.config import load_config

        cfg = load_config(str(self.config_path(principal, mode)), env={})
        return cfg.kafka, msgspec.structs.replace(cfg.redis, **redis_over) if redis_over else cfg.redis

    def reader(self, tenant: str | None):
        """RedisConfig of the reader user of `tenant` (the stack's
        configs/inflight-reader-<tenant>.yaml; None: inflight-client, jobs without one)."""
        from worker.config import load_config

        if tenant is None:
            return self.sections("producer", "mtls")[1]
        return load_config(str(self.configs / f"inflight-reader-{tenant}.yaml"), env={}).redis

    def secret(self, name: str) -> str:
        return (self.secrets / name).read_text().strip()


@pytest.fixture(scope="session")
def secure_stack() -> SecureStack:
    import json

    manifest_path = SECURE_STATE / "stack.json"
    ready = manifest_path.is_file()
    if ready:
        m = json.loads(manifest_path.read_text())
        ready = _port_open(m["kafka"]["sasl_ssl"]) and _port_open(m["redis"].split("//")[1].split("/")[0])
    if not ready:
        subprocess.run([str(ROOT / "tools" / "stack" / "devstack.sh"), "up", "--secure"], check=True, cwd=ROOT)
    return SecureStack(json.loads(manifest_path.read_text()))


def secure_worker_config(stack: SecureStack, mode: str, principal: str = "worker", **over):
    """A test worker's config on the secured stack: the principal's connection sections
    in `mode`, the stack's fixed topic prefix and group, small test tuning."""
    import msgspec

    from worker.config import MetricsConfig, ModelConfig, ServingTuning, WorkerConfig, WorkerSettings

    kafka, redis = stack.sections(principal, mode)
    kafka = msgspec.structs.replace(kafka, session_timeout_ms=6000, heartbeat_interval_ms=1000, commit_interval_ms=200,
                                    **over.pop("kafka", {}))
    redis = msgspec.structs.replace(redis, claim_lease_ms=3000, **over.pop("redis", {}))
    tuning = dict(max_running_requests=8, max_total_tokens=4096, max_batched_tokens=256, max_output_tokens=256)
    tuning.update(over.pop("tuning", {}))
    return WorkerConfig(model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=ServingTuning(**tuning),
                        kafka=kafka, redis=redis, worker=WorkerSettings(drain_timeout_s=10.0),
                        metrics=MetricsConfig(port=0, host="127.0.0.1", check_interval_s=0.5, check_timeout_s=2.0))


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory):
    """A Kafka broker and a Redis server this module stops and starts (`tools.stack.own_stack`)."""
    from tools.stack.own_stack import OwnStack

    stack = OwnStack(tmp_path_factory.mktemp("own-stack"))
    stack.up()
    yield stack
    stack.down()
