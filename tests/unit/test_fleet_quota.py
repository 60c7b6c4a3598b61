"""The local side of the fleet-wide tenant limits (worker/serve/fleet_quota.py): what the
intake may take with the shares it holds, the charges and their settlement, the rounds'
arguments, and the fallback to per-worker shares. The script itself runs against the real
Redis in tests/integration/test_fleet_quota.py."""

from __future__ import annotations

import asyncio

import pytest
import structlog
from aiokafka import TopicPartition
from redis.exceptions import ConnectionError as RedisConnectionError

from schemas.wire import Job, SamplingParams
from worker.config import ConfigError, ServingTuning, TenantPolicy
from worker.obs.metrics import Metrics
from worker.serve.fleet_quota import BYTES_PER_TOKEN_GUESS, LEASE_S, FleetQuota, fleet_limits_configured
from worker.serve.read_ahead import JobRecord, ReadAhead

TP = TopicPartition("t.jobs.normal", 0)


def rec(tenant: str, offset: int, *, ids: int | None = None, text: int = 40, max_tokens: int | None = 10) -> JobRecord:
    prompt = {"prompt_token_ids": [1] * ids} if ids is not None else {"prompt": "x" * text}
    job = Job(job_id=f"{tenant}-{offset}", tenant=tenant, params=SamplingParams(max_tokens=max_tokens), **prompt)
    return JobRecord(job, "normal", TP, offset, float(offset), b"x" * 10, None)


class FakeScript:
    """Stands for the Lua script: records each round's keys and arguments and answers
    from `replies` (or raises `error`)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, list]] = []
        self.replies: list[list[int]] = []
        self.error: BaseException | None = None

    async def __call__(self, keys, args):
        self.calls.append((keys, args))
        if self.error is not None:
            raise self.error
        return self.replies.pop(0)


def quota(tuning: ServingTuning, clock=lambda: 0.0, metrics=None) -> tuple[FleetQuota, FakeScript]:
    q = FleetQuota(None, "p", "w1", tuning, default_max_tokens=100, metrics=metrics, clock=clock)
    q._script = FakeScript()
    return q, q._script


def tenant_args(call, i: int) -> list:
    """The i-th tenant's 7 arguments of a round: rate, burst, give, need, cap, want, held."""
    return call[1][2 + 7 * i: 9 + 7 * i]


def test_config_checks_name_the_field():
    with pytest.raises(ConfigError, match=r"tenants\['a'\].fleet_tokens_per_s"):
        ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=0)})
    with pytest.raises(ConfigError, match=r"default_tenant.fleet_max_running must be >= 1"):
        ServingTuning(default_tenant=TenantPolicy(fleet_max_running=0))
    with pytest.raises(ConfigError, match=r"fleet_tokens_per_s must be in \(0, 1e\+12\], or null"):
        ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=1e20)})  # "unlimited" is unset, not huge
    with pytest.raises(ConfigError, match=r"fleet_burst_tokens must be <= 1e\+15"):
        ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=1, fleet_burst_tokens=10**16)})
    with pytest.raises(ConfigError, match="fleet_burst_tokens needs fleet_tokens_per_s"):
        ServingTuning(tenants={"a": TenantPolicy(fleet_burst_tokens=10)})
    assert not fleet_limits_configured(ServingTuning(tenants={"a": TenantPolicy(max_running_requests=2)}))
    assert fleet_limits_configured(ServingTuning(default_tenant=TenantPolicy(fleet_max_running=3)))


def test_a_tenant_without_allowance_is_passed_over_and_others_are_taken():
    tuning = ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=100)})
    q, _ = quota(tuning)
    ra = ReadAhead(per_partition=100, max_bytes=10**6)
    for o in range(3):
        ra.add(rec("a", o))
        ra.add(rec("b", 10 + o))
    taken = ra.take(6, {}, lambda t: 1.0, lambda t: 100, quota=q)
    assert {r.tenant for r in taken} == {"b"} and len(taken) == 3
    assert ra.passed_over == {"a": "fleet_tokens"}
    assert ra.waiting_by_tenant() == {"a": 3}


def test_each_record_taken_is_charged_and_the_allowance_may_go_negative_by_one_charge():
    tuning = ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=100)})
    q, _ = quota(tuning)
    q._share("a").allowance = 25.0
    ra = ReadAhead(per_partition=100, max_bytes=10**6)
    ra.add(rec("a", 0, ids=7, max_tokens=10))  # 17 tokens
    ra.add(rec("a", 1, text=40, max_tokens=None))  # 40 bytes / 4 + 1 + the default 100
    ra.add(rec("a", 2, ids=1))
    taken = ra.take(3, {}, lambda t: 1.0, lambda t: 100, quota=q)
    assert [r.charge for r in taken] == [17, 40 // BYTES_PER_TOKEN_GUESS + 1 + 100]
    assert q.shares["a"].allowance == 25 - 17 - 111
    assert ra.passed_over == {"a": "fleet_tokens"}


def test_charges_are_corrected_and_settled_with_what_the_job_used():
    tuning = ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=100)})
    q, _ = quota(tuning)
    r = rec("a", 0, text=400, max_tokens=50)
    q.charge(r)
    assert r.charge == 101 + 50
    charge = q.correct("a", r.charge, 80 + 50)  # the tokenizer found 80 prompt tokens
    assert charge == 130 and q.shares["a"].allowance == -130
    q.settle("a", charge, 80 + 12)  # it stopped after 12 of its 50 tokens
    assert q.shares["a"].allowance == -92
    q.settle("a", 0, 5)  # an uncharged job (its tenant has no fleet rate) changes nothing
    assert q.shares["a"].allowance == -92
    assert q.correct("b", 0, 40) == 0


def test_unlimited_tenants_are_never_blocked_or_charged():
    q, _ = quota(ServingTuning(tenants={"a": TenantPolicy(fleet_max_running=1)}))
    r = rec("b", 0)
    assert q.blocked("b", 10**6) is None
    q.charge(r)
    assert r.charge == 0 and "b" not in q.shares
    r = rec("a", 1)
    q.charge(r)  # a running cap only: no token charge
    assert r.charge == 0


def test_a_tenant_with_nothing_leased_asks_for_the_round_at_once():
    now = [0.0]
    q, script = quota(ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=100)}), clock=lambda: now[0])
    assert not q._wake.is_set()
    assert q.blocked("a", 0) == "fleet_tokens" and q._wake.is_set()
    script.replies.append([1, 25, -1])

    async def one_round():
        task = asyncio.create_task(q.run(lambda: {"a": 1}, dict, lambda t: 8))
        for _ in range(50):  # the woken round: well inside the 100 ms interval
            await asyncio.sleep(0.001)
            if script.calls:
                break
        task.cancel()
        return len(script.calls)

    assert asyncio.run(one_round()) == 1 and q.shares["a"].allowance == 25
    q._wake.clear()
    assert q.blocked("a", 0) is None and not q._wake.is_set()  # leased: no early round


def test_slots_a_round_may_give_away_are_not_taken_while_it_is_in_flight():
    q, script = quota(ServingTuning(tenants={"c": TenantPolicy(fleet_max_running=5)}))
    q._share("c").slots = 4
    seen = []

    async def reply(keys, args):  # the intake looks while the round is on its way
        seen.append(q.blocked("c", 1))
        return [1, 0, 1]

    q._script = reply
    asyncio.run(q.sync({}, {"c": 1}, lambda t: 8))  # nothing waits: the round shrinks to the one held
    assert seen == ["fleet_running"] and q.shares["c"].slots == 1


def test_fleet_slots_bound_the_jobs_held_here():
    q, _ = quota(ServingTuning(tenants={"a": TenantPolicy(fleet_max_running=4)}))
    assert q.blocked("a", 0) == "fleet_running"  # no slots reserved yet
    q._share("a").slots = 2
    assert q.blocked("a", 1) is None
    assert q.blocked("a", 2) == "fleet_running"


def test_a_round_leases_for_waiting_tenants_and_returns_the_rest():
    tuning = ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=200, fleet_burst_tokens=500),
                                    "c": TenantPolicy(fleet_max_running=5),
                                    "d": TenantPolicy(fleet_tokens_per_s=1000)})
    q, script = quota(tuning)
    q._share("d").allowance = 70.0  # nothing of d waits: its surplus goes back
    script.replies.append([3, 40, -1, 0, 4, 0, -1])
    asyncio.run(q.sync({"a": 2, "b": 9, "c": 3}, {"c": 1}, lambda t: 4))
    keys, args = script.calls[0]
    assert keys[0] == "p:quota:workers" and args[:2] == ["w1", 3000]
    assert keys[1:4] == ["p:quota:a:bucket", "p:quota:a:slots", "p:quota:a:leases"]
    assert tenant_args(script.calls[0], 0) == [200, 500.0, 0.0, int(200 * LEASE_S), -1, 0, 0]
    assert tenant_args(script.calls[0], 1) == [-1, 0.0, 0.0, 0, 5, 4, 1]  # want: held + waiting, at its local cap
    assert tenant_args(script.calls[0], 2)[2:4] == [70.0, 0]
    assert q.live_workers == 3
    assert q.shares["a"].allowance == 40 and q.shares["c"].slots == 4
    assert "d" not in q.shares  # settled and idle: forgotten
    assert "b" not in q.shares  # b has no fleet limit: never sent


def test_a_debt_is_asked_for_on_top_of_the_lease():
    q, script = quota(ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=100)}))
    q._share("a").allowance = -300.0
    script.replies.append([1, 10, -1])
    asyncio.run(q.sync({"a": 1}, {}, lambda t: 8))
    assert tenant_args(script.calls[0], 0)[3] == 325  # 25 (a quarter second) + the debt of 300
    assert q.shares["a"].allowance == -290


def test_redis_down_falls_back_to_the_workers_share_with_one_warning():
    now = [0.0]
    metrics = Metrics()
    tuning = ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=300, fleet_burst_tokens=600,
                                                      fleet_max_running=7),
                                    "c": TenantPolicy(fleet_max_running=1)})
    q, script = quota(tuning, clock=lambda: now[0], metrics=metrics)
    q.live_workers = 3
    script.error = RedisConnectionError("refused")

    async def two_failed_rounds():
        for _ in range(2):
            try:
                await q.sync({"a": 1}, {}, lambda t: 8)
            except RedisConnectionError as e:
                q._enter_fallback(e)

    with structlog.testing.capture_logs() as logs:
        asyncio.run(two_failed_rounds())
    assert q.fallback and [e["log_level"] for e in logs if "fall back" in e["event"]] == ["warning"]
    assert metrics.registry.get_sample_value("fleet_quota_fallback") == 1
    assert q.blocked("a", 0) == "fleet_tokens"  # nothing refilled yet
    now[0] = 0.25
    assert q.blocked("c", 1) == "fleet_running"  # a tenant with a cap only (1 slot here): a's refill goes on
    now[0] = 0.5
    assert q.blocked("a", 0) is None  # 300 / 3 tokens/s for 0.5 s
    assert q.shares["a"].allowance == pytest.approx(50)
    asyncio.run(two_failed_rounds())  # rounds that still fail leave the local share alone
    assert q.shares["a"].allowance == pytest.approx(50)
    now[0] = 100.0
    q.blocked("a", 0)
    assert q.shares["a"].allowance == pytest.approx(600 / 3)  # the bucket divided by N
    assert q.blocked("a", 2) == "fleet_running"  # 7 // 3 slots here
    script.error = None
    script.replies.append([3, 0, 2, 0, 0])  # a: no tokens, 2 slots; c: 0 slots
    with structlog.testing.capture_logs() as logs:
        asyncio.run(q.sync({"a": 1}, {"a": 2}, lambda t: 8))
    assert [e["log_level"] for e in logs] == ["info"]
    assert not q.fallback and metrics.registry.get_sample_value("fleet_quota_fallback") == 0
    assert q.live_workers == 3
    assert q.shares["a"].allowance == 0  # the surplus leased locally is dropped
    assert tenant_args(script.calls[-1], 0)[2:4] == [0.0, 0]  # asked nothing while falling back


def test_refunds_reach_the_allowance_through_the_table():
    from worker.serve.claims import Claimed
    from worker.serve.jobs import JobTable

    q, _ = quota(ServingTuning(tenants={"a": TenantPolicy(fleet_tokens_per_s=100)}))
    table = JobTable("w1")
    table.on_release = lambda h: q.settle(h.tenant or "", h.charge, h.prompt_tokens + h.num_tokens)
    r = rec("a", 0, ids=20, max_tokens=30)
    q.charge(r)
    held = table.open(r, Claimed("tok", 1, 0, 0, False))
    assert held.charge == 50 and q.shares["a"].allowance == -50
    table.hand_back(held.job_id)  # never reached the engine: all of it back
    assert q.shares["a"].allowance == 0
