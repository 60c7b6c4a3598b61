"""Scheduling under KV pressure (issue 10, cases 1 and 2), through the Engine API over a
NullRunner: head-of-line blocking with bounded skipping and its reservation, and
admission / victim rules that cannot thrash."""

from __future__ import annotations

import random

import pytest

from schemas.params import SamplingParams
from worker.config import ConfigError, EngineConfig, ServingTuning
from worker.engine.scheduler import RESERVE_AFTER_PREEMPTIONS
from worker.model.null_runner import null_engine


def engine(**tuning):
    """16-token blocks, prefix caching off (it hides recompute), 8 blocks unless told."""
    t = dict(kv_block_size=16, max_total_tokens=8 * 16, enable_prefix_caching=False, max_output_tokens=64)
    t.update(tuning)
    return null_engine(EngineConfig(serving_tuning=ServingTuning(**t)), vocab_size=100, max_model_len=2048)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


class Run:
    """Steps an engine and records, per request, the step of its first token, its
    tokens, its terminal outputs and the prefill tokens computed."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.step_no = 0
        self.first_token: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finals: dict[str, list] = {}
        self.prefill_tokens = 0

    def step(self) -> None:
        self.step_no += 1
        for o in self.eng.step():
            if o.new_token_ids:
                self.first_token.setdefault(o.request_id, self.step_no)
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finals.setdefault(o.request_id, []).append(o)
        self.prefill_tokens += self.eng.last_step_stats.num_prefill_tokens
        self.eng.check_invariants()

    def until_done(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.eng.has_unfinished():
                return
            self.step()
        raise AssertionError("engine did not finish")


# ---- case 1: head-of-line blocking ------------------------------------------------------
def test_small_request_is_not_held_back_by_a_big_one_that_does_not_fit():
    # 8 blocks of 16. `run` holds 4 blocks (5 later); `heavy` needs 5 of the 3-4 free;
    # `light` needs 1 and must not wait for `run` to finish (~20 steps).
    eng = engine(max_batched_tokens=1024)
    r = Run(eng)
    eng.add_request("run", prompt_token_ids=[1] * 60, params=params(20))
    r.step()
    eng.add_request("heavy", prompt_token_ids=[2] * 70, params=params(8))
    eng.add_request("light", prompt_token_ids=[3] * 5, params=params(4))
    added_at = r.step_no
    r.until_done()
    assert r.first_token["light"] - added_at <= 2
    assert r.first_token["heavy"] > r.first_token["light"]
    assert {rid: len(t) for rid, t in r.tokens.items()} == {"run": 20, "heavy": 8, "light": 4}
    assert all(len(f) == 1 for f in r.finals.values())
    assert eng.kv_stats().used_blocks == 0


def test_small_jobs_pass_a_waiting_600_token_job():
    # 64 blocks: three running 220-token jobs hold 42+ blocks, the 600-token job needs 38.
    eng = engine(max_total_tokens=64 * 16, max_batched_tokens=1024, max_output_tokens=128)
    r = Run(eng)
    for i in range(3):
        eng.add_request(f"run{i}", prompt_token_ids=[10 + i] * 220, params=params(40))
    r.step()
    eng.add_request("big", prompt_token_ids=[20] * 600, params=params(8))
    eng.add_request("small0", prompt_token_ids=[21] * 40, params=params(8))
    eng.add_request("small1", prompt_token_ids=[22] * 40, params=params(8))
    added_at = r.step_no
    r.until_done()
    assert r.first_token["small0"] - added_at <= 2 and r.first_token["small1"] - added_at <= 2
    assert r.first_token["big"] > r.first_token["small1"]
    assert all(len(f) == 1 for f in r.finals.values()) and len(r.finals) == 6


def heavy_under_small_stream(max_admission_skips: int, num_smalls: int = 150) -> Run:
    """One small request (5 + 10 tokens: one block, never grows) arrives every step; the
    first 8 fill the 8 blocks, then `heavy` (70 tokens: 5 blocks) arrives. From then on
    one small finishes per step and frees one block, which the next small can take."""
    eng = engine(max_batched_tokens=1024, max_admission_skips=max_admission_skips)
    r = Run(eng)
    for i in range(num_smalls):
        if i == 8:
            eng.add_request("heavy", prompt_token_ids=[2] * 70, params=params(8))
        eng.add_request(f"s{i}", prompt_token_ids=[3 + i % 50] * 5, params=params(10))
        r.step()
    r.until_done()
    return r


HEAVY_ARRIVAL = 9  # the step `heavy` is first seen


@pytest.mark.parametrize("n", [0, 3, 8])
def test_big_request_starts_within_the_bound_under_a_steady_stream_of_small_ones(n):
    """Bound on `heavy`'s wait W (steps from arrival to first token), with N =
    max_admission_skips and L = 10 (a small request's lifetime: its prefill step and 9
    decodes):

    - Before its reservation: in any L+1 consecutive steps either a small request
      passes `heavy` or `heavy` starts (if none passed, every small running at the
      window's start has finished, so all 8 blocks are free and `heavy` fits). So the
      N-th pass comes within N(L+1) steps.
    - After it nothing ranked behind `heavy` is admitted, so within L steps every
      running small has finished and `heavy` starts the next step.

    W <= N(L+1) + L + 1 = 11N + 11.
    """
    r = heavy_under_small_stream(n)
    wait = r.first_token["heavy"] - HEAVY_ARRIVAL
    assert wait <= 11 * n + 11, wait
    # nothing starves: every request ends once, with exactly its tokens
    assert len(r.finals) == 151 and all(len(f) == 1 for f in r.finals.values())
    assert all(len(t) == 10 for rid, t in r.tokens.items() if rid.startswith("s"))
    assert r.eng.kv_stats().used_blocks == 0


def test_without_a_reservation_the_stream_starves_the_big_request():
    r = heavy_under_small_stream(10**6)
    assert r.first_token["heavy"] > 150  # it starts only once the stream has ended


def test_a_lower_class_never_passes_a_blocked_higher_one_and_useless_preemption_is_not_done():
    # `h_big` (high, 5 blocks) cannot start while `h_run` (high) holds 5 of the 8 blocks;
    # preempting `l_run` (low, 1 block) would not make room, so it is left running; and
    # `l_small` (low) does not pass `h_big`, which would preempt it as soon as it could.
    eng = engine(max_batched_tokens=1024)
    r = Run(eng)
    eng.add_request("h_run", prompt_token_ids=[1] * 60, params=params(20), priority="high")
    eng.add_request("l_run", prompt_token_ids=[4] * 8, params=params(8), priority="low")
    for _ in range(5):
        r.step()
    eng.add_request("h_big", prompt_token_ids=[2] * 70, params=params(8), priority="high")
    eng.add_request("l_small", prompt_token_ids=[3] * 5, params=params(4), priority="low")
    r.until_done()
    finals = {rid: f[0] for rid, f in r.finals.items()}
    assert finals["l_run"].num_preemptions == 0
    assert r.first_token["l_small"] >= r.first_token["h_big"]
    assert r.first_token["h_big"] <= 22  # right after `h_run` (20 tokens from step 1) ends
    assert {rid: len(t) for rid, t in r.tokens.items()} == {"h_run": 20, "l_run": 8, "h_big": 8, "l_small": 4}


def test_max_admission_skips_is_validated():
    with pytest.raises(ConfigError, match="serving_tuning.max_admission_skips"):
        ServingTuning(max_admission_skips=-1)


# ---- case 2: preemption thrash ------------------------------------------------------------
def test_long_prompt_admitted_on_its_first_chunk_is_not_thrashed():
    # 8 blocks, 32-token budget: `heavy` (70 tokens) used to be admitted on its first
    # chunk, preempted at the next step and re-admitted in the same step, 16 times.
    eng = engine(max_batched_tokens=32)
    r = Run(eng)
    eng.add_request("run", prompt_token_ids=[1] * 60, params=params(20))
    r.step()
    r.step()
    eng.add_request("heavy", prompt_token_ids=[2] * 70, params=params(4))
    r.until_done()
    needed = 60 + 70
    assert r.prefill_tokens <= 1.25 * needed, r.prefill_tokens
    assert max(o.num_preemptions for f in r.finals.values() for o in f) <= 3
    assert {rid: len(t) for rid, t in r.tokens.items()} == {"run": 20, "heavy": 4}


def test_long_prompt_with_64_blocks_is_not_thrashed():
    eng = engine(max_total_tokens=64 * 16, max_batched_tokens=32, max_output_tokens=128)
    r = Run(eng)
    for i in range(3):
        eng.add_request(f"run{i}", prompt_token_ids=[10 + i] * 220, params=params(40))
    r.step()
    r.step()
    eng.add_request("big", prompt_token_ids=[20] * 600, params=params(4))
    eng.add_request("small0", prompt_token_ids=[21] * 40, params=params(4))
    eng.add_request("small1", prompt_token_ids=[22] * 40, params=params(4))
    r.until_done()
    needed = 3 * 220 + 600 + 2 * 40
    assert r.prefill_tokens <= 1.25 * needed, r.prefill_tokens
    assert max(o.num_preemptions for f in r.finals.values() for o in f) <= 3
    assert len(r.finals) == 6 and all(len(f) == 1 for f in r.finals.values())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [False, True])
def test_no_request_is_preempted_more_than_the_bound_without_priority_changes(seed, caching):
    """One priority class, KV far too small for the load: every request still finishes
    with exactly its tokens, and none is preempted more than RESERVE_AFTER_PREEMPTIONS
    times (after that it is re-admitted holding prompt + max_tokens and is no victim)."""
    rng = random.Random(seed)
    eng = engine(max_total_tokens=24 * 16, max_batched_tokens=rng.choice([16, 32, 64]), max_running_requests=8,
                 enable_prefix_caching=caching, max_output_tokens=200, priority_aging_steps=10**6)
    r = Run(eng)
    want = {}
    for i in range(40):
        rid = f"r{i}"
        want[rid] = rng.randint(1, 120)
        prompt = [rng.randint(1, 3)] * rng.randint(1, 200)
        eng.add_request(rid, prompt_token_ids=prompt, params=params(want[rid]))
        for _ in range(rng.randint(0, 3)):
            r.step()
    r.until_done()
    worst = max(o.num_preemptions for f in r.finals.values() for o in f)
    assert eng.scheduler.num_preemptions_total > 0, "the load must force preemption"
    assert worst <= RESERVE_AFTER_PREEMPTIONS <= 3, worst
    assert {rid: len(t) for rid, t in r.tokens.items()} == want
    assert all(len(f) == 1 for f in r.finals.values())
    assert eng.kv_stats().used_blocks == 0


# ---- preempted streams resume first (issue 26) ------------------------------------------
def preemption_scenario(policy: str = "optimistic", async_scheduling: bool = False):
    """The issue's case: 12 blocks of 16, 8 running at most, a 64-token budget; three
    40 + 100-token requests at step 0, two fresh ones (40 / 30 prompt tokens) added at
    step 25, after the first preemption. Returns the run, the steps at which each request
    got tokens, and after every step: the running ids and, for each request waiting
    preempted, whether the free blocks covered it and every preempted request ahead of
    it (earlier arrivals), with a slot.

    The state is read after each `step` call: after a step was applied, before the next
    schedule (with asynchronous steps, the schedule of the step after the one in flight)."""
    eng = engine(max_total_tokens=12 * 16, max_running_requests=8, max_batched_tokens=64, max_output_tokens=128,
                 kv_policy=policy, enable_prefix_caching=True, async_scheduling=async_scheduling)
    r = Run(eng)
    for i in range(3):
        eng.add_request(f"p{i}", prompt_token_ids=[1 + i] * 40, params=params(100))
    token_steps: dict[str, list[int]] = {}
    running: list[set[str]] = [set()]
    waiting: list[dict[str, bool]] = [{}]
    arrival: dict[str, int] = {}
    while eng.has_unfinished():
        if r.step_no == 25:
            eng.add_request("fresh0", prompt_token_ids=[7] * 40, params=params(100))
            eng.add_request("fresh1", prompt_token_ids=[8] * 30, params=params(100))
        before = {rid: len(t) for rid, t in r.tokens.items()}
        r.step()
        for rid, t in r.tokens.items():
            if len(t) > before.get(rid, 0):
                token_steps.setdefault(rid, []).append(r.step_no)
        sched, kv = eng.scheduler, eng.kv
        arrival.update({rid: req.arrival_seq for rid, req in sched.requests.items()})
        running.append({req.request_id for req in sched.running})
        preempted = sorted((req for req in sched.requests.values() if req.status.name == "PREEMPTED"),
                           key=lambda req: req.arrival_seq)
        need, state = 0, {}
        for req in preempted:
            need += kv.num_blocks_to_admit(req, req.num_tokens, [], sched.reserve_tokens(req))
            state[req.request_id] = kv.num_free_blocks >= need and sched.num_running < 8
        waiting.append(state)
        assert r.step_no < 2000
    return r, token_steps, running, waiting, arrival


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sequential", "async"])
def test_no_later_arrival_starts_while_a_preempted_stream_waits(async_scheduling):
    """After the step in which any request is admitted for the first time, no request
    that arrived before it is still waiting preempted."""
    r, token_steps, running, waiting, arrival = preemption_scenario(async_scheduling=async_scheduling)
    assert r.eng.scheduler.num_preemptions_total >= 3
    started: set[str] = set()
    admissions = 0
    for step in range(1, len(running)):
        for rid in running[step] - started:
            started.add(rid)
            admissions += 1
            stalled = [p for p in waiting[step] if arrival[p] < arrival[rid]]
            assert not stalled, (rid, step, stalled)
    assert {"fresh0", "fresh1"} <= started and admissions == 5
    assert {rid: len(t) for rid, t in r.tokens.items()} == {rid: 100 for rid in r.tokens}
    assert all(len(f) == 1 for f in r.finals.values()) and r.eng.kv_stats().used_blocks == 0


def preemptions(policy: str, async_scheduling: bool) -> tuple[Run, list[tuple[int, str, str]]]:
    """preemption_scenario with every preemption recorded: (step, victim, reason)."""
    from worker.engine.scheduler import Scheduler

    seen: list[tuple[int, str, str]] = []
    real = Scheduler._preempt

    def spy(self, victim, scheduled, reason):
        seen.append((self.step_count, victim.request_id, reason))
        return real(self, victim, scheduled, reason)

    Scheduler._preempt = spy
    try:
        r, *_ = preemption_scenario(policy, async_scheduling=async_scheduling)
    finally:
        Scheduler._preempt = real
    return r, seen


@pytest.mark.parametrize("policy", ["optimistic", "reserve"])
def test_asynchronous_steps_preempt_and_recompute_as_the_sequential_core(policy):
    """Steps scheduled one ahead preempt the same victims at the same steps and give the
    same tokens. A victim whose step in flight completes a KV block loses that block from
    the prefix cache (the step is applied after the blocks were freed, forward.py), so
    its recompute may be up to one block longer per preemption, never more."""
    seq, seq_preempted = preemptions(policy, False)
    asy, asy_preempted = preemptions(policy, True)
    assert asy_preempted == seq_preempted and (len(seq_preempted) >= 3 or policy == "reserve")
    assert asy.step_no == seq.step_no
    block_size = asy.eng.kv.block_size
    assert seq.prefill_tokens <= asy.prefill_tokens <= seq.prefill_tokens + block_size * len(seq_preempted)
    assert asy.tokens == seq.tokens
    assert asy.eng.kv_stats().used_blocks == 0
