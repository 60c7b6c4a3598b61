"""Fleet-wide tenant limits (worker/serve/fleet_quota.py) on the real Redis and Kafka: the
sync script's bucket and slot rules, and three workers holding one tenant to its token
rate while another tenant runs unlimited, through a 10 s Redis outage."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
import redis.asyncio as aioredis
import structlog

from schemas.params import SamplingParams
from tests.integration.conftest import worker_config
from tests.integration.helpers import assert_well_formed, slow_null_engine, start_worker, stop_worker
from worker.client import InflightClient
from worker.config import ServingTuning, TenantPolicy
from worker.serve.fleet_quota import FleetQuota

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_the_bucket_refills_on_redis_time_and_slots_never_pass_the_cap(services):
    """Two workers' rounds against one Redis: the bucket grants its size, then its rate;
    a debt given back empties it; slots are granted up to the cap whatever the order,
    never below what a worker holds, and a worker that stops syncing loses them."""
    tuning = ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=1000, fleet_burst_tokens=400,
                                                      fleet_max_running=5)})
    prefix = f"q{uuid.uuid4().hex[:8]}"

    async def main():
        r = aioredis.from_url(services[1])
        try:
            one = FleetQuota(r, prefix, "w1", tuning, default_max_tokens=10)
            two = FleetQuota(r, prefix, "w2", tuning, default_max_tokens=10)
            caps = lambda t: 100  # noqa: E731
            one._share("a").allowance = -10_000.0  # a debt: asks for the lease and the debt
            await one.sync({"a": 4}, {}, caps)
            assert one.shares["a"].allowance == -10_000 + 400  # the whole bucket, no more
            assert one.shares["a"].slots == 4 and one.live_workers == 1
            await two.sync({"a": 4}, {}, caps)
            assert two.shares["a"].allowance < 50  # the bucket refilled for a few ms only
            assert two.shares["a"].slots == 1 and two.live_workers == 2  # 5 - the 4 of w1
            await asyncio.sleep(0.2)  # ~200 tokens of refill
            await two.sync({"a": 4}, {}, caps)
            assert 150 <= two.shares["a"].allowance <= 300
            two.shares["a"].allowance = -5000.0
            await two.sync({}, {"a": 1}, caps)  # nothing waits: the debt goes onto the bucket
            assert two.shares["a"].allowance == 0 and two.shares["a"].slots == 1  # keeps what it holds
            await asyncio.sleep(0.2)
            await one.sync({"a": 4}, {"a": 4}, caps)
            assert one.shares["a"].allowance == -10_000 + 400  # the bucket is still paying the debt
            await asyncio.sleep(3.2)  # w2 stops syncing: its slot lapses with its lease
            await one.sync({"a": 4}, {"a": 4}, caps)
            assert one.shares["a"].slots == 5 and one.live_workers == 1
            await one.release()  # a clean stop frees its slots at once
            await two.sync({"a": 4}, {}, caps)
            assert two.shares["a"].slots == 4

            # the bounds of the arithmetic: the largest rate and burst, and an absurdly small rate
            edge = ServingTuning(tenants={"big": TenantPolicy(fleet_tokens_per_s=1e12, fleet_burst_tokens=10**15),
                                          "slow": TenantPolicy(fleet_tokens_per_s=1e-16)})
            three = FleetQuota(r, prefix, "w3", edge, default_max_tokens=10)
            await three.sync({"big": 1, "slow": 1}, {}, caps)
            assert three.shares["big"].allowance == 1e12 * 0.25 and three.shares["slow"].allowance == 1  # its 1-token bucket
        finally:
            await r.delete(*[k async for k in r.scan_iter(f"{prefix}:*")] or ["-"])
            await r.aclose()

    asyncio.run(main())


RATE = 300.0  # tokens/s of tenant A, across the fleet
WINDOW_S = float(os.environ.get("INFLIGHT_TEST_QUOTA_WINDOW_S", "15"))  # 60: the minute (docs/benchmarks.md)
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 10 tokens
A_JOB = SamplingParams(max_tokens=20, ignore_eos=True)  # 30 tokens a job


def tenant_tokens(workers, tenant: str) -> float:
    return sum(w.metrics.registry.get_sample_value("tenant_tokens_total", {"tenant": tenant, "kind": kind}) or 0.0
               for w in workers for kind in ("prompt", "generation"))


async def sample_held(workers, tenant: str, out: list[int]) -> None:
    while True:
        out.append(sum(w.table.held_by_tenant().get(tenant, 0) for w in workers))
        await asyncio.sleep(0.01)


def test_three_workers_hold_a_tenant_to_its_fleet_rate_through_a_redis_outage(services, prefix, own_redis):
    """A (RATE tokens/s, bucket of half a second), B (unlimited) and C (2 jobs held across
    the fleet) on three workers that could serve ~40x RATE: A's tokens over WINDOW_S stay
    within 1.1x RATE (and above 0.8x: the limit does not starve it); B's jobs all finish
    inside the window; C's jobs held across the fleet reach 2 and never pass it. Redis then
    stops for 10 s: each worker falls back with one warning, and every job of both
    tenants ends exactly once afterwards."""
    tenants = {"A": TenantPolicy(fleet_tokens_per_s=RATE, fleet_burst_tokens=int(RATE / 2)),
               "C": TenantPolicy(fleet_max_running=2)}
    cfgs = [worker_config((services[0], own_redis.url), prefix, tuning={"max_running_requests": 8, "tenants": tenants},
                          worker={"max_local_jobs": 16, "worker_id": f"quota-{i}"}) for i in range(3)]
    a_ids = [f"a-{i}" for i in range(int(RATE * (WINDOW_S + 8) / 30))]  # A's backlog outlasts the window
    b_ids = [f"b-{i}" for i in range(60)]
    c_ids = [f"c-{i}" for i in range(20)]

    async def main():
        started = [await start_worker(c, slow_null_engine(0.01, max_running_requests=8)) for c in cfgs]
        workers = [w for w, _ in started]
        try:
            async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix,
                                      results_fallback_s=2.0) as client:
                t0 = time.monotonic()
                before = tenant_tokens(workers, "A")
                await asyncio.gather(*(client.submit(prompt_token_ids=PROMPT, params=A_JOB, job_id=j, tenant="A")
                                       for j in a_ids))
                await asyncio.gather(*(client.submit(prompt_token_ids=PROMPT, params=A_JOB, job_id=j, tenant=j[0].upper())
                                       for j in b_ids + c_ids))
                c_held = []  # C's jobs held across the fleet, sampled
                sampler = asyncio.create_task(sample_held(workers, "C", c_held))
                b_done = await asyncio.gather(*(client.result(j, WINDOW_S, tenant="B") for j in b_ids))
                b_elapsed = time.monotonic() - t0
                c_done = await asyncio.gather(*(client.result(j, WINDOW_S, tenant="C") for j in c_ids))
                sampler.cancel()
                await asyncio.sleep(t0 + WINDOW_S - time.monotonic())
                a_rate = (tenant_tokens(workers, "A") - before) / (time.monotonic() - t0)
                with structlog.testing.capture_logs() as logs:
                    own_redis.stop(keep_data=True)
                    deadline = time.monotonic() + 10
                    while not all(w.quota.fallback for w in workers) and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)
                    fell_back = [w.quota.fallback for w in workers]
                    await asyncio.sleep(deadline - time.monotonic())
                    own_redis.start()
                    deadline = time.monotonic() + 30
                    while any(w.quota.fallback for w in workers) and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)
                found = {}
                deadline = time.monotonic() + 120
                every = a_ids + b_ids + c_ids
                while len(found) < len(every) and time.monotonic() < deadline:
                    found = await client.lookup_results(every)
                    await asyncio.sleep(1)
                whole = {j: await client.read_log(j, tenant=j[0].upper()) for j in every}
        finally:
            for w, task in started:
                await stop_worker(w, task)
        return b_done, b_elapsed, c_done, c_held, a_rate, fell_back, logs, found, whole

    b_done, b_elapsed, c_done, c_held, a_rate, fell_back, logs, found, whole = asyncio.run(main())
    assert all(f.finish_reason == "length" for f in b_done) and b_elapsed < WINDOW_S
    assert all(f.finish_reason == "length" for f in c_done)
    assert max(c_held) == 2, sorted(set(c_held))  # reached, never passed
    assert 0.8 * RATE <= a_rate <= 1.1 * RATE, a_rate
    assert fell_back == [True, True, True]
    warnings = [e for e in logs if "fall back" in e["event"]]
    assert len(warnings) == 3 and all(e["log_level"] == "warning" for e in warnings), warnings
    assert sorted(found) == sorted(a_ids + b_ids + c_ids), sorted(set(a_ids + b_ids + c_ids) - set(found))
    for j, events in whole.items():
        fin = assert_well_formed(events, j)
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 20, (j, fin)
    print(f"A: {a_rate:.0f} tokens/s of {RATE:.0f} over {WINDOW_S:.0f} s ({a_rate / RATE:.3f}x); "
          f"B's {len(b_ids)} jobs in {b_elapsed:.1f} s")
