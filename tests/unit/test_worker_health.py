"""The worker's readiness (worker/serve/health.py) with planted Redis and Kafka parts: a
Redis refusal shows while the Kafka half of the same check still waits, and a worker
stopping because a task was refused stays unready with the refusal named, although its
check loop stopped with it (the flake of test_security's Redis rotation: the intake met
the refused password first, the worker stopped, and /readyz kept the last "ready")."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import redis.exceptions as rex

from worker.config import KafkaConfig, RedisConfig
from worker.obs.metrics import Metrics
from worker.serve.health import HealthChecks


class RefusingRedis:
    """Refuses the password; with `after`, only once that event is set (the refusal
    arrives while the Kafka half is mid-request)."""

    def __init__(self, after: asyncio.Event | None = None) -> None:
        self.after = after

    async def ping(self) -> bool:
        if self.after is not None:
            await self.after.wait()
        raise rex.AuthenticationError("invalid username-password pair or user is disabled.")


class SlowConsumer:
    """A consumer (with nothing assigned) whose cluster requests wait until `release` is
    set (a request queued behind a long-poll fetch on the broker connection); it is its
    own aiokafka client (`_client`) and cluster, with one broker."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = asyncio.Event()
        self._client = self.cluster = self

    def assignment(self) -> set:
        return set()

    def paused(self) -> set:
        return set()

    def brokers(self) -> list:
        return [SimpleNamespace(nodeId=1)]

    async def send(self, node: int, request) -> SimpleNamespace:
        self.waiting.set()
        await self.release.wait()
        return SimpleNamespace(brokers=[(node, "127.0.0.1", 9092, None)])


def planted(consumer, redis=None) -> HealthChecks:
    checks = HealthChecks(Metrics(), liveness=lambda: (True, {}))
    intake = SimpleNamespace(consumer=consumer, cfg=KafkaConfig(), log_start={}, lag=lambda ends: {})
    publisher = SimpleNamespace(cfg=RedisConfig(username="worker"))
    checks.attach(redis or RefusingRedis(), intake, SimpleNamespace(epoch=1), publisher, SimpleNamespace(num_unfinished=0),
                  SimpleNamespace(device="cpu"), is_draining=lambda: False)
    checks.kafka_ok = checks.redis_ok = True  # the last check passed
    return checks


def test_a_redis_refusal_is_seen_while_the_kafka_half_of_the_check_still_waits():
    async def main():
        consumer = SlowConsumer()
        checks = planted(consumer, RefusingRedis(after=consumer.waiting))
        check = asyncio.create_task(checks.check(timeout=30.0))
        try:  # one after the other, the Redis half would wait for the Kafka half (for ever here)
            async with asyncio.timeout(2.0):
                while checks.redis_ok:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            pass
        during = checks.readiness()
        consumer.release.set()
        await check
        return during, checks.readiness()

    (ready, body), (ready_after, _) = asyncio.run(main())
    assert ready is False and body["checks"]["redis"] is False and body["checks"]["kafka"] is True
    assert "Redis authentication failed" in body["errors"]["redis"] and "redis.password" in body["errors"]["redis"]
    assert ready_after is False


def test_a_worker_stopped_by_a_refusal_is_unready_and_names_it():
    checks = planted(SlowConsumer())
    assert checks.readiness()[0] is True
    checks.stopped_by(rex.AuthenticationError("invalid username-password pair or user is disabled."))
    ready, body = checks.readiness()
    assert ready is False and body["checks"]["redis"] is False
    assert "Redis authentication failed" in body["errors"]["redis"]


def test_a_stop_for_another_cause_leaves_the_services_verdicts_alone():
    checks = planted(SlowConsumer())
    checks.stopped_by(RuntimeError("the engine process died"))
    ready, body = checks.readiness()
    assert ready is True and "errors" not in body  # the worker's stop itself shows as not_draining

