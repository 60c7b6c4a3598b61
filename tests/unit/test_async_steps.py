"""Asynchronous engine steps (`serving_tuning.async_scheduling`): the next step is
launched before the last one's outputs are built. The schedule and the tokens are those
of the sequential core; a request ended by output processing (a stop string) or an abort
while a step is in flight may have one token computed in that step, which is dropped:
never emitted, not counted; an abort frees its KV blocks by the end of the step in
flight (the next step boundary)."""

from __future__ import annotations

import dataclasses

import pytest

from schemas.params import SamplingParams
from worker.config import EngineConfig, ServingTuning
from worker.model.null_runner import null_engine


def make(async_scheduling: bool, device_ms: float = 0.0, **tuning):
    cfg = EngineConfig(serving_tuning=ServingTuning(**{
        "max_running_requests": 4, "max_total_tokens": 512, "max_batched_tokens": 32, "kv_block_size": 4,
        "async_scheduling": async_scheduling, **tuning}))
    # token = position mod 26: the letters run on (LetterTokenizer: id i -> chr(97 + i % 26))
    eng = null_engine(cfg, vocab_size=26, eos_token_ids=frozenset({25}), max_model_len=256,
                      next_token=lambda s: len(s.all_token_ids) % 25, device_ms=device_ms)
    computed: list[tuple[str, int]] = []  # (request, tokens it had when a step sampled for it)
    real = eng.runner.launch

    def spy(sched, after=None):
        computed.extend((s.request_id, len(s.all_token_ids)) for s in sched.scheduled if s.samples_token)
        return real(sched, after)

    eng.runner.launch = spy
    real_exec = eng.runner.execute

    def spy_exec(sched):
        computed.extend((s.request_id, len(s.all_token_ids)) for s in sched.scheduled if s.samples_token)
        return real_exec(sched)

    eng.runner.execute = spy_exec
    return eng, computed


def drain(eng, adds=None):
    adds = adds or {}
    outs, step = [], 0
    while eng.has_unfinished() or step in adds:
        for fn in adds.get(step, []):
            fn(eng)
        outs.append([(o.request_id, tuple(o.new_token_ids), o.text, o.finished, o.finish_reason,
                      o.usage.completion_tokens if o.usage else None) for o in eng.step()])
        eng.check_invariants()
        step += 1
        assert step < 1000
    return outs


def workload(eng):
    eng.add_request("stop", prompt_token_ids=[0, 1, 2], params=SamplingParams(max_tokens=50, stop=["gh"]))
    eng.add_request("len", prompt_token_ids=[5] * 9, params=SamplingParams(max_tokens=7))
    eng.add_request("eos", prompt_token_ids=[1] * 20, params=SamplingParams(max_tokens=40))  # 25 at position 25


def test_same_outputs_step_by_step_as_the_sequential_core():
    seq, seq_computed = make(False)
    asy, asy_computed = make(True)
    workload(seq)
    workload(asy)
    late = {3: [lambda e: e.add_request("late", prompt_token_ids=[3, 4], params=SamplingParams(max_tokens=5))]}
    a, b = drain(seq, late), drain(asy, late)
    flat = lambda outs: sorted(x for step in outs for x in step)  # noqa: E731
    assert flat(a) == flat(b)  # same tokens, text, finish reasons and usage for every request
    assert [x for x in flat(b) if x[0] == "stop"][-1][4] == "stop"
    # the stop string ended "stop" after the step in flight had sampled for it: one extra
    # token computed, never emitted; EOS and length stops compute nothing extra
    extra = [rid for rid in ("stop", "len", "eos", "late")
             if sum(1 for r, _ in asy_computed if r == rid) != sum(1 for r, _ in seq_computed if r == rid)]
    assert extra == ["stop"]
    assert sum(1 for r, _ in asy_computed if r == "stop") == sum(1 for r, _ in seq_computed if r == "stop") + 1
    assert asy.kv_stats().used_blocks == 0 and seq.kv_stats().used_blocks == 0


def test_a_late_request_starts_one_step_later_and_gets_the_same_tokens():
    seq, _ = make(False)
    asy, _ = make(True)
    for e in (seq, asy):
        e.add_request("a", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=6, ignore_eos=True))
    add = {2: [lambda e: e.add_request("b", prompt_token_ids=[4, 5], params=SamplingParams(max_tokens=4))]}
    a, b = drain(seq, add), drain(asy, add)
    first = lambda outs: next(i for i, step in enumerate(outs) if any(x[0] == "b" for x in step))  # noqa: E731
    assert first(b) == first(a) + 1
    assert sorted(x[:2] for s in a for x in s if x[0] == "b") == sorted(x[:2] for s in b for x in s if x[0] == "b")


@pytest.mark.parametrize("device_ms", [0.0, 3.0])
def test_abort_frees_kv_by_the_next_boundary_and_drops_the_token_in_flight(device_ms):
    eng, computed = make(True, device_ms=device_ms)
    eng.add_request("x", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=100, ignore_eos=True))
    eng.add_request("y", prompt_token_ids=[4, 5, 6], params=SamplingParams(max_tokens=100, ignore_eos=True))
    emitted = 0
    for _ in range(5):
        emitted += sum(len(o.new_token_ids) for o in eng.step() if o.request_id == "x")
    assert eng.core._in_flight  # steps are on the device
    held_before = eng.kv_stats().used_blocks
    eng.abort("x")
    outs = eng.step()  # collects step 6: x's token from it is dropped, x ends cancelled
    mine = [o for o in outs if o.request_id == "x"]
    assert len(mine) == 1 and mine[0].finished and mine[0].finish_reason == "cancelled"
    assert mine[0].new_token_ids == [] and mine[0].usage.completion_tokens == emitted
    assert sum(1 for r, _ in computed if r == "x") == emitted + 1  # computed in step 6, never emitted
    assert eng.kv_stats().used_blocks < held_before  # freed when the step that applied the abort returned
    assert "x" not in eng.core.scheduler.requests
    while eng.has_unfinished():
        eng.step()
    assert eng.kv_stats().used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sequential", "async"])
def test_an_abort_of_a_request_added_in_the_same_window_is_not_lost(async_scheduling):
    # regression: with a step in flight the abort pass before the update ran ahead of the
    # queued add, found no such request, and dropped the abort; the add then started
    eng, computed = make(async_scheduling)
    eng.add_request("x", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    eng.add_request("late", prompt_token_ids=[4, 5, 6], params=SamplingParams(max_tokens=20, ignore_eos=True))
    eng.abort("late")
    outs = [o for o in eng.step() if o.request_id == "late"]
    assert [(o.finished, o.finish_reason, o.new_token_ids) for o in outs] == [(True, "cancelled", [])]
    assert "late" not in eng.core.scheduler.requests and eng.core.kv.block_table("late") == []
    while eng.has_unfinished():
        assert all(o.request_id != "late" for o in eng.step())
    assert not any(r == "late" for r, _ in computed)  # never scheduled
    assert eng.kv_stats().used_blocks == 0


def test_a_failing_forward_in_flight_follows_the_sequential_rules():
    eng, _ = make(True)
    eng.add_request("ok", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=4, ignore_eos=True))
    eng.add_request("bad", prompt_token_ids=[3, 4], params=SamplingParams(max_tokens=4, ignore_eos=True))
    real = eng.runner.execute

    def execute(sched):
        if any(s.request_id == "bad" for s in sched.scheduled):
            raise RuntimeError("kernel failed\nsecond line")
        return real(sched)

    eng.runner.execute = execute  # a runner without launch (the null runner computes at launch): the fallback
    eng.runner.capabilities = dataclasses.replace(eng.runner.capabilities, async_launch=False)
    outs = [o for _ in range(8) for o in eng.step()]
    bad = [o for o in outs if o.request_id == "bad"]
    assert bad[-1].finish_reason == "error" and len(bad) == 1
    ok = [o for o in outs if o.request_id == "ok"]
    assert sum(len(o.new_token_ids) for o in ok) == 4 and ok[-1].finish_reason == "length"
    assert not eng.has_unfinished() and eng.kv_stats().used_blocks == 0


def ending_token(s) -> int:
    """Null-model tokens: "eos" samples EOS (25) once it holds 12 tokens, "stopid" its stop
    token id 24 once it holds 10; else position mod 20 (never 24 or 25)."""
    n = len(s.all_token_ids)
    if s.request_id.startswith("eos") and n == 12:
        return 25
    if s.request_id == "stopid" and n == 10:
        return 24
    return n % 20


def make_ending(async_scheduling: bool):
    cfg = EngineConfig(serving_tuning=ServingTuning(max_running_requests=4, max_total_tokens=512,
                                                    max_batched_tokens=32, kv_block_size=4,
                                                    async_scheduling=async_scheduling))
    eng = null_engine(cfg, vocab_size=26, eos_token_ids=frozenset({25}), max_model_len=256,
                      next_token=ending_token, device_ms=1.0)
    sampled: list[str] = []
    real = eng.runner._start

    def spy(sched):
        sampled.extend(s.request_id for s in sched.scheduled if s.samples_token)
        return real(sched)

    eng.runner._start = spy
    return eng, sampled


def test_eos_and_a_stop_id_one_step_ahead_compute_one_token_more_that_is_never_emitted():
    runs = {}
    for mode in (False, True):
        eng, sampled = make_ending(mode)
        eng.add_request("eos", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=50))
        eng.add_request("stopid", prompt_token_ids=[4, 5], params=SamplingParams(max_tokens=50, stop_token_ids=[24]))
        eng.add_request("len", prompt_token_ids=[6], params=SamplingParams(max_tokens=15, ignore_eos=True))
        runs[mode] = drain(eng), sampled
        assert eng.kv_stats().used_blocks == 0
    flat = lambda outs: sorted(x for step in outs for x in step)  # noqa: E731
    (seq, seq_sampled), (asy, asy_sampled) = runs[False], runs[True]
    assert flat(seq) == flat(asy)  # same ids, text, finish reasons and usage
    finals = {x[0]: x for x in flat(asy) if x[3]}
    assert finals["eos"][4] == "stop" and finals["eos"][5] == 10 and finals["stopid"][4] == "stop"
    assert finals["len"][4] == "length" and finals["len"][5] == 15
    extra = {rid: asy_sampled.count(rid) - seq_sampled.count(rid) for rid in ("eos", "stopid", "len")}
    assert extra == {"eos": 1, "stopid": 1, "len": 0}  # length is known ahead: nothing extra


def test_a_step_in_flight_for_an_ended_request_never_reaches_a_new_request_of_the_same_id():
    # the request ended by EOS while the step launched behind it computed one more token
    # for it; a new request with the same id added at once must not receive that token
    results = {}
    for mode in (False, True):
        eng, _ = make_ending(mode)
        eng.add_request("eos-x", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=50))
        again: list[tuple[int, ...]] = []
        added = False
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished and o.request_id == "eos-x" and not added:
                    added = True
                    eng.add_request("eos-x", prompt_token_ids=[9, 9, 9, 9, 9], params=SamplingParams(max_tokens=6))
                elif added and o.request_id == "eos-x":
                    again.append((tuple(o.new_token_ids), o.finish_reason))
            eng.check_invariants()
        results[mode] = again
        assert eng.kv_stats().used_blocks == 0
    assert results[True] == results[False]
    assert [t for ids, _ in results[True] for t in ids] == [n % 20 for n in range(5, 11)]


def test_a_steps_inputs_stay_as_scheduled_while_the_steps_behind_it_are_built():
    """The core updates a request's `ScheduledRequest` in place two steps later
    (worker/engine/batch.py): a launched step must still read what it was scheduled with
    when the runner gets to it, after the step behind it was built."""
    eng, _ = make(True, device_ms=1.0)
    real = eng.runner.launch
    checked = []

    def state(sched):
        return [(s.request_id, tuple(s.token_ids), s.start_pos, s.samples_token, tuple(s.draft)) for s in sched.scheduled]

    class Checked:
        def __init__(self, sched, handle):
            self.sched, self.handle = sched, handle
            self.at_launch = state(sched)
            self.tables = [list(s.block_ids) for s in sched.scheduled]

        def result(self):
            assert state(self.sched) == self.at_launch
            # a table may have grown since (the next schedule appends); what the step read is unchanged
            assert [list(s.block_ids[:len(t)]) for s, t in zip(self.sched.scheduled, self.tables)] == self.tables
            checked.append(self.sched.step)
            return self.handle.result()

        def failed(self):
            return False

    eng.runner.launch = lambda sched, after=None: Checked(sched, real(sched, after.handle if after else None))
    workload(eng)
    drain(eng)
    assert len(checked) > 10
