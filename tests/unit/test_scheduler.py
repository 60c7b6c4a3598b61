"""Scheduler, admission and KV invariants through the Engine API over a NullRunner
(no model): exactly the production code above the model runner."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.params import SamplingParams
from worker.config import EngineConfig, ServingTuning
from worker.engine import RejectReason, RequestRejected
from worker.model.null_runner import null_engine

EOS = 0


def engine(**tuning):
    tuning.setdefault("kv_block_size", 4)
    return null_engine(EngineConfig(serving_tuning=ServingTuning(**tuning)), vocab_size=100, max_model_len=256)


def run_all(eng, max_steps=10_000):
    outs = []
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return outs
        outs.extend(eng.step())
        eng.check_invariants()
    raise AssertionError("engine did not finish")


# ---- KV invariant (property-based) ------------------------------------------------
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(1, 3), min_size=1, max_size=40),  # small alphabet: shared prefixes
            st.integers(1, 30),
            st.sampled_from(["high", "normal", "low"]),
        ),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, policy=st.sampled_from(["optimistic", "reserve"]), caching=st.booleans())
def test_kv_invariant_under_random_add_abort_step(ops, policy, caching):
    eng = engine(
        max_total_tokens=96, max_batched_tokens=16, max_running_requests=4, kv_policy=policy,
        enable_prefix_caching=caching, max_input_tokens=64, max_output_tokens=32,
    )
    total = eng.kv_stats().total_blocks
    n = 0
    finished: set[str] = set()
    terminal: dict[str, int] = {}
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, prio = op
            try:
                eng.add_request(f"r{n}", prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens), priority=prio)
            except RequestRejected as e:
                assert e.reason == RejectReason.EXCEEDS_KV_CAPACITY
            n += 1
        elif op[0] == "abort":
            rid = f"r{op[1]}"
            eng.abort(rid)
            outs = eng.step()
            # blocks of an aborted request are free after the step boundary
            assert eng.kv.block_table(rid) == []
            for o in outs:
                if o.finished:
                    terminal[o.request_id] = terminal.get(o.request_id, 0) + 1
                    finished.add(o.request_id)
        else:
            for _ in range(op[1]):
                for o in eng.step():
                    if o.finished:
                        terminal[o.request_id] = terminal.get(o.request_id, 0) + 1
                        finished.add(o.request_id)
        s = eng.kv_stats()
        assert s.free_blocks + s.used_blocks + s.cached_blocks == total
        eng.check_invariants()
    # abort of finished and unknown ids is a no-op
    for rid in list(finished)[:3] + ["never-added"]:
        eng.abort(rid)
        assert all(not o.finished or o.request_id not in finished for o in eng.step())
    for o in run_all(eng):
        if o.finished:
            terminal[o.request_id] = terminal.get(o.request_id, 0) + 1
    assert all(v == 1 for v in terminal.values()), terminal  # exactly one final output each
    s = eng.kv_stats()
    assert s.used_blocks == 0
    assert s.free_blocks + s.cached_blocks == total


# ---- admission ------------------------------------------------------------------------
def test_admission_edges_reject_at_once_while_others_proceed():
    eng = engine(max_total_tokens=64, max_input_tokens=20, max_output_tokens=40, max_batched_tokens=32)
    eng.add_request("running", prompt_token_ids=[5] * 10, params=SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    assert eng.add_request("at-limit", prompt_token_ids=[5] * 20, params=SamplingParams(max_tokens=1)) == 20
    cases = {
        "over-limit": ([5] * 21, 1, RejectReason.PROMPT_TOO_LONG),
        "empty": ([], 1, RejectReason.EMPTY_PROMPT),
    }
    for rid, (prompt, max_tokens, reason) in cases.items():
        with pytest.raises(RequestRejected) as exc:
            eng.add_request(rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens))
        assert exc.value.reason == reason
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
    outs = run_all(eng)
    finals = {o.request_id: o for o in outs if o.finished}
    assert set(finals) == {"running", "at-limit"}
    assert finals["running"].usage.completion_tokens == 30

    small = engine(max_total_tokens=32, max_input_tokens=30, max_output_tokens=250)  # <= the context of 256
    assert small.add_request("fits", prompt_token_ids=[5] * 20, params=SamplingParams(max_tokens=12)) == 20
    with pytest.raises(RequestRejected) as exc:
        small.add_request("never-fits", prompt_token_ids=[5] * 20, params=SamplingParams(max_tokens=13))
    assert exc.value.reason == RejectReason.EXCEEDS_KV_CAPACITY
    with pytest.raises(RequestRejected) as exc:
        small.add_request("context", prompt_token_ids=[5] * 20, params=SamplingParams(max_tokens=237))
    assert exc.value.reason == RejectReason.EXCEEDS_CONTEXT  # 257 > max_model_len 256
    with pytest.raises(RequestRejected) as exc:
        small.add_request("fits", prompt_token_ids=[5], params=SamplingParams(max_tokens=1))
    assert exc.value.reason == RejectReason.DUPLICATE_REQUEST_ID
    run_all(small)


# ---- priority -------------------------------------------------------------------------
def test_high_priority_preempts_full_batch_of_low_within_two_steps():
    eng = engine(max_total_tokens=1024, max_running_requests=4, max_batched_tokens=64, max_output_tokens=200)
    for i in range(4):
        eng.add_request(f"low{i}", prompt_token_ids=[7] * 8, params=SamplingParams(max_tokens=200, ignore_eos=True), priority="low")
    for _ in range(3):
        eng.step()
    assert eng.scheduler.num_running == 4
    eng.add_request("high", prompt_token_ids=[9] * 8, params=SamplingParams(max_tokens=5), priority="high")
    steps = 0
    got_token = False
    while not got_token:
        steps += 1
        got_token = any(o.request_id == "high" and o.new_token_ids for o in eng.step())
    assert steps <= 2
    assert eng.scheduler.num_preemptions_total >= 1
    outs = run_all(eng)
    finals = {o.request_id: o for o in outs if o.finished}
    # preempted low requests still deliver exactly max_tokens, none re-sent
    for i in range(4):
        assert finals[f"low{i}"].usage.completion_tokens == 200


def test_low_priority_never_starves_under_steady_high_stream():
    eng = engine(max_total_tokens=2048, max_running_requests=2, max_batched_tokens=64,
                 max_output_tokens=64, priority_aging_steps=20)
    for i in range(3):
        eng.add_request(f"low{i}", prompt_token_ids=[3] * 4, params=SamplingParams(max_tokens=10, ignore_eos=True), priority="low")
    finished = set()
    k = 0
    for step in range(600):
        if step % 2 == 0:  # a new high request every other step keeps both slots contended
            eng.add_request(f"high{k}", prompt_token_ids=[4] * 4, params=SamplingParams(max_tokens=6, ignore_eos=True), priority="high")
            k += 1
        finished |= {o.request_id for o in eng.step() if o.finished}
        if {"low0", "low1", "low2"} <= finished:
            break
    assert {"low0", "low1", "low2"} <= finished


# ---- counts and stop precedence -------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 2, 17])
def test_exact_max_tokens(max_tokens):
    eng = engine(max_total_tokens=256)
    eng.add_request("a", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=max_tokens))
    outs = run_all(eng)
    ids = [t for o in outs for t in o.new_token_ids]
    assert len(ids) == max_tokens
    assert outs[-1].finish_reason == "length"
    assert outs[-1].usage.completion_tokens == max_tokens
    assert sum(o.finished for o in outs) == 1


def scripted(tokens):
    def next_token(s):
        return tokens[len(s.all_token_ids) - 1 - 2]  # prompt has 3 tokens; output index = len - 3

    return next_token


def test_eos_on_last_allowed_token_is_stop_not_length():
    # Precedence: a stop (EOS / stop token / stop string) on the max_tokens-th token wins over length.
    eng = null_engine(EngineConfig(serving_tuning=ServingTuning(max_total_tokens=256, kv_block_size=4)),
                      vocab_size=100, next_token=scripted([11, 12, EOS]))
    eng.add_request("a", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=3))
    outs = run_all(eng)
    assert outs[-1].finish_reason == "stop"
    assert [t for o in outs for t in o.new_token_ids] == [11, 12, EOS]  # EOS is in the ids ...
    assert outs[-1].usage.completion_tokens == 3


def test_ignore_eos_and_stop_token_ids():
    eng = null_engine(EngineConfig(serving_tuning=ServingTuning(max_total_tokens=256, kv_block_size=4)),
                      vocab_size=100, next_token=scripted([11, EOS, 12, 13, 14, 15]))
    eng.add_request("ign", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4, ignore_eos=True))
    eng.add_request("stop", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=6, stop_token_ids=[13]))
    outs = run_all(eng)
    ids = {rid: [t for o in outs if o.request_id == rid for t in o.new_token_ids] for rid in ("ign", "stop")}
    final = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert ids["ign"] == [11, EOS, 12, 13] and final["ign"] == "length"
    assert ids["stop"] == [11, EOS] and final["stop"] == "stop"


def test_stop_string_ends_request_and_text_excludes_it():
    # LetterTokenizer: id i -> chr(97 + i % 26); ids 7,4,11,11,14 spell "hello"
    eng = null_engine(EngineConfig(serving_tuning=ServingTuning(max_total_tokens=256, kv_block_size=4)),
                      vocab_size=100, next_token=scripted([7, 4, 11, 11, 14, 22, 14]))
    eng.add_request("a", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=7, stop=["llo"]))
    outs = run_all(eng)
    assert "".join(o.text for o in outs) == "he"
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].usage.completion_tokens == 5


def test_reserve_policy_never_preempts():
    eng = engine(max_total_tokens=64, max_running_requests=8, kv_policy="reserve", max_output_tokens=40)
    for i in range(6):
        eng.add_request(f"r{i}", prompt_token_ids=[2] * 8, params=SamplingParams(max_tokens=20, ignore_eos=True))
    outs = run_all(eng)
    assert eng.scheduler.num_preemptions_total == 0
    assert sum(o.finished for o in outs) == 6


def test_optimistic_policy_preempts_and_counts_each_token_once():
    eng = engine(max_total_tokens=64, max_running_requests=8, kv_policy="optimistic", max_output_tokens=40)
    for i in range(6):
        eng.add_request(f"r{i}", prompt_token_ids=[2] * 8, params=SamplingParams(max_tokens=20, ignore_eos=True))
    outs = run_all(eng)
    assert eng.scheduler.num_preemptions_total > 0
    for i in range(6):
        ids = [t for o in outs if o.request_id == f"r{i}" for t in o.new_token_ids]
        assert len(ids) == 20
        assert [o for o in outs if o.request_id == f"r{i}" and o.finished][0].usage.completion_tokens == 20
