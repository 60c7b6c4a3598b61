"""The InflightClient as an application uses it: many submits at once from one client."""

from __future__ import annotations

import asyncio

import worker.client.inflight as inflight
from schemas.params import SamplingParams
from worker.client import InflightClient


def test_concurrent_first_submits_start_one_producer(services, prefix, monkeypatch):
    """The producer is made on first use; twenty submits that arrive before it exists
    share the one producer (each used to start its own, and all but one leaked)."""
    started = []

    class Counting(inflight.AIOKafkaProducer):
        async def start(self):
            started.append(self)
            await super().start()

    monkeypatch.setattr(inflight, "AIOKafkaProducer", Counting)

    async def main():
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            ids = await asyncio.gather(*(client.submit("x", params=SamplingParams(max_tokens=1), job_id=f"c-{i}")
                                         for i in range(20)))
        return ids

    assert sorted(asyncio.run(main())) == sorted(f"c-{i}" for i in range(20))
    assert len(started) == 1

