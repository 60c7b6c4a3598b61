"""Per-tenant fair share (VTC) and quotas inside a priority class, through the Engine API
over a NullRunner: exactly the production code above the model runner."""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.params import SamplingParams
from worker.config import ConfigError, EngineConfig, ServingTuning, TenantPolicy, load_config
from worker.engine import RejectReason, RequestRejected
from worker.engine.scheduler import RESERVE_AFTER_PREEMPTIONS
from worker.model.null_runner import null_engine

W_PREFILL, W_DECODE = 1.0, 2.0  # the defaults of fair_prefill_weight / fair_decode_weight


def tuning(**over) -> ServingTuning:
    t = dict(kv_block_size=16, max_total_tokens=32768, max_running_requests=8, max_batched_tokens=512,
             max_output_tokens=512, enable_prefix_caching=False, priority_aging_steps=10**6)
    t.update(over)
    return ServingTuning(**t)


def engine(**over):
    """A NullRunner engine; tests/engine/test_fair_share_model.py runs the same
    scenarios on the tiny real model."""
    return null_engine(EngineConfig(serving_tuning=tuning(**over)), vocab_size=1000, max_model_len=4096)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


class Load:
    """Adds requests of tenants as scheduled and records, per step and tenant, the
    service delivered in VTC's units (prompt tokens x w_p when the first token comes,
    output tokens x w_d) and each request's first-token step.

    `added_at` is the first step that can schedule the request: the next one, or with
    asynchronous steps the one after (the next is already on the device: `lag`)."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.lag = 1 if eng.core.async_scheduling else 0
        self.step_no = 0
        self.prompt_len: dict[str, int] = {}
        self.tenant_of: dict[str, str] = {}
        self.added_at: dict[str, int] = {}
        self.first_token: dict[str, int] = {}
        self.service: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.finals: dict[str, list] = collections.defaultdict(list)
        self._n = 0

    def add(self, tenant: str, n: int, prompt: int, max_tokens: int, priority: str = "normal") -> list[str]:
        ids = []
        for _ in range(n):
            rid = f"{tenant}-{self._n}"
            self._n += 1
            tokens = [(self._n * 31 + j) % 499 + 1 for j in range(prompt)]  # < the tiny model's 512
            self.eng.add_request(rid, prompt_token_ids=tokens, params=params(max_tokens), tenant=tenant,
                                 priority=priority)
            self.prompt_len[rid], self.tenant_of[rid], self.added_at[rid] = prompt, tenant, self.step_no + self.lag
            ids.append(rid)
        return ids

    def step(self) -> None:
        for o in self.eng.step():
            t = self.tenant_of[o.request_id]
            if o.new_token_ids:
                self.service[self.step_no][t] += W_DECODE * len(o.new_token_ids)
                if o.request_id not in self.first_token:
                    self.first_token[o.request_id] = self.step_no
                    self.service[self.step_no][t] += W_PREFILL * self.prompt_len[o.request_id]
            if o.finished:
                self.finals[o.request_id].append(o)
        self.step_no += 1

    def steps_to_schedule(self) -> None:
        """Step until the requests added since the last step have been scheduled once."""
        for _ in range(1 + self.lag):
            self.step()

    def shares(self, lo: int, hi: int) -> dict[str, float]:
        total: collections.Counter = collections.Counter()
        for s in range(lo, hi):
            total.update(self.service.get(s, {}))
        whole = sum(total.values())
        return {t: v / whole for t, v in total.items()}


def test_light_tenant_starts_within_the_bound_behind_a_backlogged_one(make_engine=engine):
    """A: 500 requests of 32 + 256 tokens, all at step 0, so A holds all R = 8 slots and
    stays backlogged. B: 20 requests of 8 + 8 tokens, one every 20 steps from step 100.

    Bound: each B request gets its first token in the step it arrives (wait 0 steps).
    Derivation, for B's request j arriving at step s (fair_share.py's rules):
      - B holds nothing then: its request j-1 lived 8 steps (the step budget, 512,
        takes the 8 decodes plus its 8-token prompt) and ended 12 steps earlier.
      - Counter: request j-1 was admitted with counter_B <= counter_A (Pick or Yield),
        then B was charged 8 w_p + 8 w_d = 24 while A, with 7 slots, was charged
        7 x 8 x w_d = 112; so B left behind A, and B's lift (to counter_A plus its
        negative lag) keeps counter_B <= counter_A.
      - Pick: B has the least counter (a tie goes to the tenant with fewer running).
      - Yield: no slot is free, but A holds 8 >= 2 x (0 + 1) slots and is not behind B,
        so B preempts A's latest running request (if an A request ended in the step
        before, a Yield waits a step, but its slot is free and Pick gives it to B); one
        exists that is not reserved:
        every B request costs one preemption, a request is reserved after
        RESERVE_AFTER_PREEMPTIONS = 2, and A's running set is renewed every 256 steps,
        over which at most 13 B requests arrive (16 would be needed to reserve all 8).
      - KV is ample (32768 tokens), so the admission gets its blocks, and the prompt
        fits the step budget left: its first token is sampled in step s.
    """
    assert RESERVE_AFTER_PREEMPTIONS == 2
    eng = make_engine()
    load = Load(eng)
    load.add("A", 500, 32, 256)
    light = []
    while load.step_no < 520:
        if load.step_no >= 100 and (load.step_no - 100) % 20 == 0 and len(light) < 20:
            light += load.add("B", 1, 8, 8)
        load.step()
    waits = [load.first_token[r] - load.added_at[r] for r in light]
    assert waits == [0] * 20, waits
    assert all(len(load.finals[r]) == 1 and load.finals[r][0].usage.completion_tokens == 8 for r in light)
    # each B request preempted exactly one A request (the Yield), nothing else did
    assert eng.scheduler.num_preemptions_total == 20


def test_the_light_tenant_bound_holds_with_asynchronous_steps():
    # the same bound, counted from the first step that can schedule the request
    test_light_tenant_starts_within_the_bound_behind_a_backlogged_one(lambda: engine(async_scheduling=True))


def test_without_fair_share_the_light_tenant_waits_for_a_slot():
    eng = engine(fair_share=False)
    load = Load(eng)
    load.add("A", 500, 32, 256)
    for _ in range(100):
        load.step()
    (b,) = load.add("B", 1, 8, 8)
    for _ in range(300):
        load.step()
    assert b not in load.first_token  # arrival order: 492 A requests go first


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sequential", "async"])
def test_a_tenant_behind_a_flood_holds_its_half_while_the_floods_victim_waits(async_scheduling):
    """Regression (CI, stop 40: tests/integration/test_fairness.py): R = 4 slots, the
    worker's defaults feeding the engine: A keeps 5 requests of 200 tokens here, B
    arrives with 8 of 20 tokens, at most 2 here at a time. B's first takes a slot at once
    by Yield; A's victim then resumed first whenever a slot freed and stood before B's
    next request, which never got the second slot the lag rule (b) owes it: B ran one
    request at a time (its 8th started 140 steps after arrival; 90 with 2 local). Now a
    preempted request whose tenant would yield the resumed slot at once waits behind
    Pick, so B holds 2 of the 4 slots: its requests start in pairs, the 8th within 4
    rounds of 20 steps, at no more than one preemption per B request (3 / 8 here,
    sequential / async; 3 / 7 before)."""
    eng = engine(max_running_requests=4, async_scheduling=async_scheduling)
    load = Load(eng)
    a_live = set(load.add("A", 5, 2, 200))

    def refill(live: set, tenant: str, max_tokens: int, keep: int, budget: int | None = None) -> list[str]:
        for r in [r for r in live if load.finals.get(r)]:
            live.discard(r)
        n = keep - len(live) if budget is None else min(keep - len(live), budget)
        ids = load.add(tenant, n, 2, max_tokens) if n > 0 else []
        live.update(ids)
        return ids

    for _ in range(150):
        load.step()
        refill(a_live, "A", 200, 5)
    preemptions_before = eng.scheduler.num_preemptions_total
    arrival, b_live, b_ids = load.step_no + load.lag, set(), []
    while len(b_ids) < 8 or b_live:
        b_ids += refill(b_live, "B", 20, 2, budget=8 - len(b_ids))
        load.step()
        refill(a_live, "A", 200, 5)
    starts = [load.first_token[r] - arrival for r in b_ids]
    assert starts[0] <= 1 and max(starts) <= 4 * 20 + 2, starts
    assert all(len(load.finals[r]) == 1 and load.finals[r][0].finished for r in b_ids)
    assert eng.scheduler.num_preemptions_total - preemptions_before <= len(b_ids), starts


@pytest.mark.parametrize("weights", [(1, 1), (3, 1)])
def test_backlogged_tenants_converge_to_their_weights(weights, make_engine=engine):
    """A (64-token prompts, 64 out) and B (16, 16) both backlogged; over steps 200-1500
    each tenant's service (w_p x prompt + w_d x output tokens) is its weight's share
    within 10%, although their requests differ 4x in size."""
    w_a, w_b = weights
    eng = make_engine(tenants={"A": TenantPolicy(weight=w_a), "B": TenantPolicy(weight=w_b)})
    load = Load(eng)
    load.add("A", 400, 64, 64)
    load.add("B", 1500, 16, 16)
    for _ in range(1500):
        load.step()
    shares = load.shares(200, 1500)
    for tenant, w in (("A", w_a), ("B", w_b)):
        want = w / (w_a + w_b)
        assert abs(shares[tenant] - want) <= 0.1 * want, (tenant, shares)
    # the balance comes from Pick, not from preempting: few Yields
    assert eng.scheduler.num_preemptions_total <= 40


def test_a_tenant_idle_then_bursting_does_not_starve_the_others(make_engine=engine):
    """A and B backlogged from step 0. C sends 5 small requests at step 0 and then
    nothing until step 1000, when it sends 300. Without the lift C would come back with
    a counter ~1000 steps of service below A's and B's and take every admission until
    it caught up; with it, C starts level and the three share from the first window."""
    eng = make_engine()
    load = Load(eng)
    load.add("A", 400, 64, 64)
    load.add("B", 1500, 16, 16)
    load.add("C", 5, 16, 16)
    for _ in range(1000):
        load.step()
    early = {r for r in load.first_token if load.tenant_of[r] == "C"}
    assert len(early) == 5
    load.add("C", 300, 16, 32)
    for _ in range(600):
        load.step()
    for lo, hi in ((1000, 1200), (1200, 1600)):
        shares = load.shares(lo, hi)
        assert all(abs(shares[t] - 1 / 3) <= 0.1 / 3 for t in "ABC"), (lo, hi, shares)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sequential", "async"])
def test_priority_classes_stay_ahead_of_tenant_share(async_scheduling):
    # B has the least counter, but A's high request still goes first
    eng = engine(max_running_requests=2, async_scheduling=async_scheduling)
    load = Load(eng)
    load.add("A", 2, 8, 50)
    for _ in range(10):
        load.step()
    (b,) = load.add("B", 1, 8, 4)
    (a_high,) = load.add("A", 1, 8, 4, priority="high")
    load.steps_to_schedule()
    assert a_high in load.first_token and b not in load.first_token


# ---- quotas ------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sequential", "async"])
def test_a_tenant_at_its_running_cap_waits_while_another_starts_in_the_same_step(async_scheduling):
    eng = engine(max_running_requests=4, tenants={"T": TenantPolicy(max_running_requests=1)},
                 async_scheduling=async_scheduling)
    load = Load(eng)
    (t0,) = load.add("T", 1, 8, 40)
    load.step()
    t1, t2 = load.add("T", 2, 8, 4)
    (u0,) = load.add("U", 1, 8, 4)
    load.steps_to_schedule()
    assert load.first_token[u0] == load.added_at[u0]  # started the first step it could, beside T's t0
    assert t1 not in load.first_token and t2 not in load.first_token  # slots free, T at its cap
    assert eng.scheduler.num_running == 2
    while eng.has_unfinished():
        load.step()
        assert sum(1 for r in eng.scheduler.running if r.tenant == "T") <= 1
    assert load.first_token[t1] >= 40 and load.first_token[t2] > load.first_token[t1]
    assert {r: f[0].usage.completion_tokens for r, f in load.finals.items()} == {t0: 40, t1: 4, t2: 4, u0: 4}


def test_kv_quota_holds_blocks_to_the_cap_and_rejects_what_can_never_fit():
    # 8 blocks of 16 tokens for T; each request needs 2-4 blocks as it grows
    eng = engine(kv_block_size=16, enable_prefix_caching=True, tenants={"T": TenantPolicy(max_kv_blocks=8)})
    load = Load(eng)
    with pytest.raises(RequestRejected) as exc:
        eng.add_request("too-big", prompt_token_ids=[1] * 100, params=params(29), tenant="T")
    assert exc.value.reason == RejectReason.EXCEEDS_KV_CAPACITY and "quota" in exc.value.message
    t_ids = load.add("T", 6, 20, 40)
    u_ids = load.add("U", 3, 20, 40)
    peak = 0
    while eng.has_unfinished():
        load.step()
        held = eng.kv.num_blocks_held("T")
        assert held <= 8, held
        peak = max(peak, held)
        eng.check_invariants()
    assert peak >= 6  # the cap was reached, not avoided
    assert all(load.first_token[u] == 0 for u in u_ids)  # U never waited for T's quota
    assert {r: f[0].usage.completion_tokens for r, f in load.finals.items()} == {r: 40 for r in t_ids + u_ids}
    assert eng.kv_stats().used_blocks == 0


def test_quota_fields_are_validated_by_name():
    with pytest.raises(ConfigError, match=r"serving_tuning\.tenants\['acme'\]\.weight"):
        ServingTuning(tenants={"acme": TenantPolicy(weight=0)})
    with pytest.raises(ConfigError, match=r"serving_tuning\.default_tenant\.max_running_requests"):
        ServingTuning(default_tenant=TenantPolicy(max_running_requests=0))
    with pytest.raises(ConfigError, match=r"serving_tuning\.tenants\['b'\]\.max_kv_blocks"):
        load_config(env={"INFLIGHT_SERVING_TUNING__TENANTS": "{b: {max_kv_blocks: -1}}"})
    with pytest.raises(ConfigError, match=r"serving_tuning\.fair_decode_weight"):
        ServingTuning(fair_decode_weight=0)
    cfg = load_config(env={"INFLIGHT_SERVING_TUNING__TENANTS": "{acme: {weight: 3, max_running_requests: 2}}"})
    assert cfg.serving_tuning.tenant_policy("acme").weight == 3
    assert cfg.serving_tuning.tenant_policy("other") == TenantPolicy()


# ---- invariants under random load ---------------------------------------------------
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from("TUV"), st.integers(1, 40), st.integers(1, 30),
                  st.sampled_from(["high", "normal", "low"])),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=60,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, policy=st.sampled_from(["optimistic", "reserve"]), fair=st.booleans())
def test_quotas_and_kv_invariants_under_random_tenants(ops, policy, fair):
    eng = null_engine(EngineConfig(serving_tuning=ServingTuning(
        kv_block_size=4, max_total_tokens=96, max_batched_tokens=16, max_running_requests=4, kv_policy=policy,
        max_input_tokens=64, max_output_tokens=32, fair_share=fair,
        tenants={"T": TenantPolicy(max_running_requests=1, weight=3), "U": TenantPolicy(max_kv_blocks=12)})),
        vocab_size=100, max_model_len=256)
    terminal: collections.Counter = collections.Counter()
    accepted: set[str] = set()

    def step():
        for o in eng.step():
            if o.finished:
                terminal[o.request_id] += 1
        eng.check_invariants()
        running = eng.scheduler.running
        assert sum(1 for r in running if r.tenant == "T") <= 1
        assert eng.kv.num_blocks_held("U") <= 12

    for n, op in enumerate(ops):
        if op[0] == "add":
            _, tenant, plen, max_tokens, prio = op
            try:
                eng.add_request(f"r{n}", prompt_token_ids=[1 + n % 3] * plen, params=SamplingParams(max_tokens=max_tokens),
                                priority=prio, tenant=tenant)
                accepted.add(f"r{n}")
            except RequestRejected as e:
                assert e.reason == RejectReason.EXCEEDS_KV_CAPACITY
        elif op[0] == "abort":
            eng.abort(f"r{op[1]}")
            step()
        else:
            for _ in range(op[1]):
                step()
    for _ in range(5000):
        if not eng.has_unfinished():
            break
        step()
    assert not eng.has_unfinished()
    assert set(terminal) == accepted and all(v == 1 for v in terminal.values()), terminal
    assert eng.kv_stats().used_blocks == 0 and not eng.scheduler.tenants
