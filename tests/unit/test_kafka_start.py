"""A worker's Kafka clients ride out a broker that is away at start
(`KafkaOutage.ride_out`): transient errors are reported and retried with backoff until
the client starts, a refusal stops at once, and an outage past `kafka.outage_limit_s`
stops with KafkaUnavailable (no broker needed: a fake clock and client)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from worker.security.kafka import KafkaUnavailable
from worker.serve.kafka_outage import KafkaOutage


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


AWAY = KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 9)]")


def client(failures: int, error: Exception = AWAY):
    calls = []

    async def start() -> None:
        calls.append(1)
        if len(calls) <= failures:
            raise error

    return start, calls


def test_a_broker_away_at_start_is_waited_for_with_backoff():
    clock = Clock()
    outage = KafkaOutage(60.0, clock=clock)
    start, calls = client(failures=5)
    asyncio.run(outage.ride_out("producer", start, sleep=clock.sleep))
    assert len(calls) == 6 and clock.sleeps == [0.5, 1.0, 2.0, 4.0, 5.0]
    assert not outage.down and outage.num_episodes == 1  # reported, then resolved


def test_a_refusal_at_start_stops_at_once():
    clock = Clock()
    start, calls = client(failures=1, error=TopicAuthorizationFailedError())
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(KafkaOutage(60.0, clock=clock).ride_out("intake", start, sleep=clock.sleep))
    assert len(calls) == 1 and clock.sleeps == []


def test_an_outage_at_start_past_the_limit_stops_the_worker():
    clock = Clock()
    start, calls = client(failures=1000)
    with pytest.raises(KafkaUnavailable, match="kafka.outage_limit_s = 12.0"):
        asyncio.run(KafkaOutage(12.0, clock=clock).ride_out("cancels", start, sleep=clock.sleep))
    assert 12.0 < clock.t <= 17.0 and len(calls) > 3


def test_transient_errors_are_counted_by_part_and_class():
    """Each transient error a part meets is counted by part and error class, beside the
    outage gauge: an operator tells a broker away from a write waiting for replicas."""
    from aiokafka.errors import NotEnoughReplicasError

    from worker.obs.metrics import Metrics

    m = Metrics()
    outage = KafkaOutage(limit_s=60, metrics=m, clock=Clock())
    outage.failed("results", NotEnoughReplicasError())
    outage.failed("results", NotEnoughReplicasError())
    outage.failed("cancels", AWAY)
    assert m.kafka_errors.labels("results", "NotEnoughReplicasError")._value.get() == 2
    assert m.kafka_errors.labels("cancels", "KafkaConnectionError")._value.get() == 1
    assert m.kafka_outage._value.get() == 1


def test_a_write_kafka_does_not_acknowledge_is_an_outage_while_it_waits(monkeypatch):
    """An idempotent producer's batch never expires: a write with no leader or too few
    in-sync replicas just waits. The finalizer reports it as an outage each
    `UNACKED_REPORT_S` (so `kafka.outage_limit_s` still applies), keeps waiting on the
    same write (never sends it twice), and reports Kafka back when it is acknowledged."""
    from worker.obs.metrics import Metrics
    from worker.serve import finalize

    monkeypatch.setattr(finalize, "UNACKED_REPORT_S", 0.05)
    m = Metrics()
    outage = KafkaOutage(limit_s=60, metrics=m)
    sends = []

    async def write():
        sends.append(1)
        await asyncio.sleep(0.28)

    async def main():
        await finalize._retrying(write, "record outcomes", ["j"], outage)

    asyncio.run(main())
    assert sends == [1]
    assert m.kafka_errors.labels("results", "KafkaTimeoutError")._value.get() >= 4
    assert not outage.down and m.kafka_outage._value.get() == 0
