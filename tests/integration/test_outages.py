"""Redis outages and restarts against a Redis server each test starts and stops itself
(never the shared dev stack): the worker rides out short outages with its jobs running,
gives up promptly after `redis.outage_limit_s` so its partitions move, restores what
clients rely on when Redis comes back empty, and the client's streams survive restarts."""

from __future__ import annotations

import asyncio
import time

from schemas import keys
from schemas.params import SamplingParams
from schemas.wire import Finished, Restarted, Started, Token
from tests.integration.conftest import worker_config
from tests.integration.helpers import (
    assert_well_formed,
    collect,
    finished_within,
    read_whole_log,
    slow_null_engine,
    start_worker,
    stop_worker,
)
from worker.client import InflightClient, text_of
from worker.serve.publish import RedisUnavailable


def own_config(services, prefix, own_redis, **over):
    return worker_config((services[0], own_redis.url), prefix, **over)


async def wait_tokens(client, job_id: str, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = await client.read_log(job_id)
        if sum(len(e.token_ids) for e in evs if isinstance(e, Token)) >= n:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{job_id} streamed fewer than {n} tokens")


def check_log(events: list, job_id: str) -> Finished:
    """A log read from its first entry: seq without gaps, one terminal event, text whole."""
    fin = assert_well_formed(events, job_id)
    assert text_of(events) == fin.text
    assert any(isinstance(e, Started) for e in events)
    return fin


def test_a_15_s_redis_outage_is_ridden_out(services, prefix, own_redis):
    cfg = own_config(services, prefix, own_redis)
    engine = slow_null_engine(0.005)
    params = SamplingParams(max_tokens=1000, ignore_eos=True)

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix) as client:
            await client.submit("long", params=params, job_id="long")
            await wait_tokens(client, "long", 20)
            own_redis.stop(keep_data=True)
            t0 = time.monotonic()
            await client.submit("during", params=SamplingParams(max_tokens=5, ignore_eos=True), job_id="during")
            while time.monotonic() - t0 < 15:
                assert not task.done(), "the worker must ride out the outage"
                await asyncio.sleep(0.5)
            own_redis.start()
            long_events = await collect(client, "long", 60)
            during = await collect(client, "during", 60)
            alive = not task.done()
            outages = w.metrics.redis_outage._value.get()
        await stop_worker(w, task)
        return long_events, during, alive, outages, await read_whole_log(own_redis.url, prefix, "long")

    long_events, during, alive, outage_gauge, log = asyncio.run(main())
    assert alive and outage_gauge == 0
    fin = check_log(long_events, "long")
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == 1000 and fin.attempt == 1
    assert check_log(log, "long").text == fin.text
    assert check_log(during, "during").finish_reason == "length"


def test_an_outage_longer_than_the_limit_stops_the_worker_and_the_job_moves(services, prefix, own_redis):
    cfg = own_config(services, prefix, own_redis, redis={"outage_limit_s": 3.0})
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main():
        w, task = await start_worker(cfg, slow_null_engine(0.02))
        async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix) as client:
            await client.submit("moved", params=params, job_id="moved")
            await wait_tokens(client, "moved", 10)
            own_redis.stop(keep_data=True)
            t0 = time.monotonic()
            try:
                await finished_within(task, 30, "the worker past the Redis outage limit")
                stopped_with = None
            except RedisUnavailable as e:
                stopped_with = e
            exit_s = time.monotonic() - t0
            own_redis.start()
            w2, task2 = await start_worker(cfg, slow_null_engine(0.002))
            events = await collect(client, "moved", 90)
            await stop_worker(w2, task2)
        return stopped_with, exit_s, events

    stopped_with, exit_s, events = asyncio.run(main())
    assert isinstance(stopped_with, RedisUnavailable) and "outage_limit_s" in str(stopped_with)
    assert exit_s < 3.0 + 20.0  # the limit, then a bounded close
    fin = check_log(events, "moved")
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == 400
    assert fin.attempt == 2 and any(isinstance(e, Restarted) for e in events)


def test_eight_live_streams_survive_a_redis_restart(services, prefix, own_redis):
    cfg = own_config(services, prefix, own_redis)
    params = SamplingParams(max_tokens=300, ignore_eos=True)

    async def main():
        w, task = await start_worker(cfg, slow_null_engine(0.01))
        async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix) as client:
            ids = [f"s-{i}" for i in range(8)]
            for j in ids:
                await client.submit(j, params=params, job_id=j)
            streams = [asyncio.create_task(collect(client, j, 120)) for j in ids]
            await wait_tokens(client, ids[-1], 5)
            own_redis.stop(keep_data=True)
            await asyncio.sleep(3)
            own_redis.start()
            results = await asyncio.gather(*streams)
        await stop_worker(w, task)
        return ids, results

    ids, results = asyncio.run(main())
    for j, evs in zip(ids, results):
        fin = check_log(evs, j)  # no event twice, none missing, one terminal
        assert fin.usage.completion_tokens == 300


def test_redis_restarting_empty_keeps_every_log_whole(services, prefix, own_redis):
    cfg = own_config(services, prefix, own_redis)
    params = SamplingParams(max_tokens=500, ignore_eos=True)

    async def main():
        w, task = await start_worker(cfg, slow_null_engine(0.01))
        async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix) as client:
            ids = [f"e-{i}" for i in range(4)]
            for j in ids:
                await client.submit(j, params=params, job_id=j)
            streams = [asyncio.create_task(collect(client, j, 120)) for j in ids]
            await wait_tokens(client, ids[-1], 20)
            own_redis.stop(keep_data=False)
            await asyncio.sleep(5)
            own_redis.start()  # empty
            live = await asyncio.gather(*streams)
            restores = w.publisher.num_restores
        await stop_worker(w, task)
        logs = [await read_whole_log(own_redis.url, prefix, j) for j in ids]
        import redis.asyncio as aioredis

        r = aioredis.from_url(own_redis.url)
        attempts = [int(await r.get(keys.attempts_key(j, prefix)) or 0) for j in ids]
        await r.aclose()
        return ids, live, logs, attempts, restores

    ids, live, logs, attempts, restores = asyncio.run(main())
    assert restores >= 1
    for j, evs, log, attempt in zip(ids, live, logs, attempts):
        fin = check_log(log, j)  # read from its first entry after the loss
        assert fin.usage.completion_tokens == 500 and fin.attempt == 1
        assert [e.seq for e in evs] == [e.seq for e in log] and check_log(evs, j).text == fin.text
        assert attempt >= fin.attempt  # attempts never go backwards


def test_outcomes_survive_redis_restarting_empty(services, prefix, own_redis):
    cfg = own_config(services, prefix, own_redis)

    async def main():
        w, task = await start_worker(cfg, slow_null_engine(0.0))
        async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix) as client:
            ids = [f"o-{i}" for i in range(50)]
            for i, j in enumerate(ids):
                await client.submit(f"job {i}", params=SamplingParams(max_tokens=1 + i % 7, ignore_eos=True), job_id=j)
            before = await asyncio.gather(*(client.result(j, 60) for j in ids))
        await stop_worker(w, task)
        own_redis.stop(keep_data=False)
        own_redis.start()  # empty, and no worker left to restore anything
        async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix,
                                  results_fallback_s=0.5) as client:
            assert await client.read_log(ids[0]) == []
            after = await asyncio.gather(*(client.result(j, 60) for j in ids))
            found = await client.lookup_results(ids)
        return before, after, found

    before, after, found = asyncio.run(main())
    assert len(found) == 50
    for b, a in zip(before, after):
        assert a.job_id == b.job_id and a.text == b.text and a.seq == b.seq and a.finish_reason == b.finish_reason
        assert a.usage.completion_tokens == b.usage.completion_tokens


def test_a_cancel_while_redis_is_away_still_sends_the_cancel_message(services, prefix, own_redis):
    """The tombstone is the client's shortcut; the cancel message is the cancel. With
    Redis away (an outage, a Sentinel failover in progress) `cancel` still sends it."""
    from schemas.codec import decode_cancel
    from tests.integration.helpers import read_topic

    own_redis.stop(keep_data=False)

    async def main():
        async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix) as client:
            async with asyncio.timeout(60):
                await client.cancel("away-1", reason="user")
        return await read_topic(services[0], keys.cancel_topic(prefix), decode_cancel, timeout_ms=10_000)

    cancels = asyncio.run(main())
    assert [(c.job_id, c.reason) for c in cancels] == [("away-1", "user")]
