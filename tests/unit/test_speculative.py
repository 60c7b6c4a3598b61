"""Speculative decoding's pure logic (worker/engine/speculative.py) and its rules in the
scheduler, on the null runner (no model): the prompt-lookup proposer, the acceptance
rule, the pauses, and that a speculating engine emits exactly the tokens of one that does
not, ends at stop tokens and `max_tokens` inside an accepted run, frees a cancelled
request's blocks at the next step, and survives preemption."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.params import SamplingParams
from worker.config import ConfigError, EngineConfig, ServingTuning, SpeculativeConfig
from worker.engine.speculative import (
    PAUSE_STEPS,
    SpecState,
    Speculation,
    ngram_proposal,
    num_accepted,
)
from worker.model.null_runner import null_engine

PERIOD = 5


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_ngram_proposal_takes_the_latest_occurrence_of_the_longest_suffix():
    # suffix [7, 8]: occurs at 0-1 (then 1, 2) and at 5-6 (then 9, 9); the latest wins
    assert ngram_proposal(arr(7, 8, 1, 2, 3, 7, 8, 9, 9, 4, 7, 8), 1, 3, 2) == [9, 9]
    # a longer match wins over a later shorter one: [6, 7, 8] occurs only at 0-2
    assert ngram_proposal(arr(6, 7, 8, 1, 2, 5, 7, 8, 3, 6, 7, 8), 1, 3, 3) == [1, 2, 5]
    # k caps the proposal; the end of the tokens caps it too
    assert ngram_proposal(arr(1, 2, 3, 4, 5, 1, 2), 2, 2, 2) == [3, 4]
    assert ngram_proposal(arr(1, 2, 1, 2), 2, 2, 8) == [1, 2]


def test_ngram_proposal_needs_min_n_tokens_of_match():
    assert ngram_proposal(arr(1, 2, 3, 9, 3), 2, 4, 4) == []  # only [3] matched
    assert ngram_proposal(arr(1, 2, 3, 9, 3), 1, 4, 4) == [9, 3]
    assert ngram_proposal(arr(5), 1, 4, 4) == []
    assert ngram_proposal(arr(1, 2, 3, 4), 1, 4, 4) == []
    # a match at the very start (no token before it to extend it) still counts
    assert ngram_proposal(arr(4, 5, 6, 4), 1, 3, 2) == [5, 6]


def test_num_accepted_is_the_confirmed_prefix():
    assert num_accepted([1, 2, 3, 4], [1, 2, 3]) == 3
    assert num_accepted([1, 9, 3, 4], [1, 2, 3]) == 1
    assert num_accepted([9, 2, 3, 4], [1, 2, 3]) == 0
    assert num_accepted([1, 2], [1, 2, 3]) == 2


def test_spec_state_grows_with_the_tokens():
    state = SpecState()
    tokens = list(range(10))
    assert state.sync(tokens).tolist() == tokens
    tokens += list(range(100, 300))
    assert state.sync(tokens).tolist() == tokens
    assert state.num_tokens == 210


class Req:
    """The fields of a scheduler request the proposer reads."""

    def __init__(self, tokens: list[int], max_tokens: int = 100) -> None:
        self.all_token_ids = tokens
        self.grammar = None
        self.num_output_placeholders = 0
        self.max_tokens = max_tokens
        self.num_prompt_tokens = 2
        self.spec = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens


def test_drafts_that_keep_little_pause_a_request_and_the_pause_doubles():
    spec = Speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=4, min_accepted_tokens=2.0))
    req = Req([1, 2, 3, 1, 2])
    assert spec.propose(req, 1, 10) == [3, 1, 2]
    spec.verified(req, 3, 3, 1)  # a draft kept whole: the average (from k = 4) stays high
    assert req.spec.paused_until == 0
    for _ in range(3):  # nothing kept: the average falls 3.75 -> 2.81 -> 2.11 -> 1.58
        spec.verified(req, 3, 0, 1)
    assert req.spec.paused_until == 1 + PAUSE_STEPS
    assert spec.propose(req, PAUSE_STEPS, 10) == []
    assert spec.propose(req, PAUSE_STEPS + 1, 10) == [3, 1, 2]
    spec.verified(req, 3, 0, 20)  # on probation: one more miss pauses it twice as long
    assert req.spec.paused_until == 20 + 2 * PAUSE_STEPS
    assert spec.stats.num_drafts == 5 and spec.stats.num_draft_tokens == 15 and spec.stats.num_accepted_tokens == 3


def test_proposals_respect_max_tokens_budget_and_batch_size():
    spec = Speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=2))
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    assert spec.propose(Req(list(tokens)), 1, 10) == [3, 1, 2]  # the end of the tokens caps it
    assert spec.propose(Req(list(tokens), max_tokens=8), 1, 10) == [3]  # 6 out, 8 max: one guess + the last token
    assert spec.propose(Req(list(tokens), max_tokens=7), 1, 10) == []
    assert spec.propose(Req(list(tokens)), 1, 1) == [3]  # the step's budget left
    assert spec.active(2) and not spec.active(3)


class Grammar:
    """A grammar state that allows tokens below 3 only."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.raw = self

    def validate_tokens(self, tokens: list[int]) -> int:
        return next((i for i, t in enumerate(tokens) if t >= 3), len(tokens))


def test_a_constrained_requests_draft_stops_at_the_first_guess_its_grammar_refuses():
    spec = Speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    req = Req([1, 2, 0, 1, 5, 1, 2])
    req.grammar = Grammar()
    assert spec.propose(req, 1, 10) == [0, 1]  # the lookup's [0, 1, 5, 1] cut before 5
    req.grammar = Grammar(done=True)
    assert spec.propose(req, 1, 10) == []


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="serving_tuning.speculative.method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ConfigError, match="async_scheduling"):
        ServingTuning(async_scheduling=True, speculative=SpeculativeConfig(method="ngram"))


# ---- the engine on the null runner ---------------------------------------------------------
def periodic(s) -> int:
    """A "model" that repeats its last PERIOD tokens: prompt lookup guesses it exactly."""
    ids = s.all_token_ids
    n = s.start_pos + len(s.token_ids)
    return ids[n - PERIOD] if n >= PERIOD else 7


def drifting(s) -> int:
    """Repeats its last PERIOD tokens, but every 4th position one higher: guesses miss."""
    n = s.start_pos + len(s.token_ids)
    return periodic(s) + (n % 4 == 0)


def engine(method: str, next_token=periodic, **tuning):
    spec = SpeculativeConfig(method=method, prompt_lookup_min=1, disable_by_batch_size=None, min_speedup=None,
                             min_accepted_tokens=0.0)
    return null_engine(EngineConfig(serving_tuning=ServingTuning(speculative=spec, **tuning)), next_token=next_token,
                       eos_token_ids=frozenset({0}))


def run(eng, prompts, params) -> tuple[dict[str, list[int]], dict]:
    tokens: dict[str, list[int]] = {}
    finals = {}
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", prompt_token_ids=p, params=params)
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        eng.core.check_invariants()
    return tokens, finals


PROMPTS = [[3, 4, 5, 6, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


@pytest.mark.parametrize("next_token", [periodic, drifting])
def test_same_tokens_in_fewer_steps(next_token):
    params = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)
    off, on = engine("off", next_token), engine("ngram", next_token)
    plain, plain_finals = run(off, PROMPTS, params)
    spec, spec_finals = run(on, PROMPTS, params)
    assert spec == plain
    assert all(len(t) == 37 and spec_finals[r].usage.completion_tokens == 37 for r, t in spec.items())
    stats = on.scheduler.speculation.stats
    assert stats.num_accepted_tokens > 0
    assert on.scheduler.step_count < off.scheduler.step_count
    if next_token is drifting:
        assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_stop_token_inside_an_accepted_run_ends_there():
    # after the prefill's 6 the lookup guesses [9, 8, 2, 5], all confirmed; 9 is a stop token:
    # nothing after it is emitted or counted
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[9])
    on = engine("ngram")
    tokens, finals = run(on, [[5, 6, 9, 8, 2, 5]], params)
    assert tokens["r0"] == [6, 9] and finals["r0"].finish_reason == "stop"
    assert finals["r0"].usage.completion_tokens == 2
    assert on.scheduler.speculation.stats.num_accepted_tokens == 4
    assert on.kv_stats().used_blocks == 0


def test_max_tokens_is_never_exceeded_and_eos_ends_a_run():
    for max_tokens in (1, 2, 3, 5, 6, 11):
        tokens, finals = run(engine("ngram"), PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                      ignore_eos=True))
        assert all(len(t) == max_tokens for t in tokens.values()), (max_tokens, tokens)
        assert all(f.finish_reason == "length" for f in finals.values())
    on = engine("ngram")  # after the prefill's 2 the lookup guesses [0, 4, 5, 1]: EOS (0) first
    tokens, finals = run(on, [[1, 2, 0, 4, 5, 1]], SamplingParams(temperature=0, max_tokens=20))
    assert tokens["r0"] == [2, 0] and finals["r0"].finish_reason == "stop"
    assert on.scheduler.speculation.stats.num_accepted_tokens == 4


def test_a_cancelled_speculating_request_frees_its_blocks_at_the_next_step():
    on = engine("ngram")
    on.add_request("r0", prompt_token_ids=list(range(1, 40)) * 2,
                   params=SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(6):
        on.step()
    assert on.scheduler.speculation.stats.num_drafts > 0 and on.kv_stats().used_blocks > 0
    on.abort("r0")
    outs = on.step()
    assert [o.finish_reason for o in outs] == ["cancelled"]
    assert on.kv_stats().used_blocks == 0


def test_preemption_under_kv_pressure_keeps_the_tokens():
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [list(range(10 * i + 1, 10 * i + 9)) for i in range(6)]
    plain, _ = run(engine("off", max_total_tokens=256, max_running_requests=6), prompts, params)
    on = engine("ngram", max_total_tokens=256, max_running_requests=6)
    spec, _ = run(on, prompts, params)
    assert spec == plain
    assert on.scheduler.num_preemptions_total > 0 and on.scheduler.speculation.stats.num_accepted_tokens > 0


def test_step_stats_count_the_drafts():
    on = engine("ngram")
    on.add_request("r0", prompt_token_ids=[1, 2, 3, 1, 2, 3, 1], params=SamplingParams(temperature=0, max_tokens=9,
                                                                                    ignore_eos=True))
    drafts = accepted = decode_tokens = 0
    while on.has_unfinished():
        on.step()
        st = on.last_step_stats
        drafts += st.spec.num_drafts
        accepted += st.spec.num_accepted_tokens
        decode_tokens += st.num_decode_tokens
    stats = on.scheduler.speculation.stats
    assert (drafts, accepted) == (stats.num_drafts, stats.num_accepted_tokens) and drafts > 0
    assert sum(stats.accepted_per_pos) == accepted
    assert decode_tokens == stats.num_draft_tokens + stats.num_drafts + (8 - accepted - stats.num_drafts)


def test_vllm_engine_refuses_our_speculative_section():
    from worker.config import ModelConfig

    with pytest.raises(ConfigError, match="speculative_config"):
        EngineConfig(model=ModelConfig(engine="vllm", vllm_python="/usr/bin/python3"),
                     serving_tuning=ServingTuning(speculative=SpeculativeConfig(method="ngram")))


def test_step_cost_measures_both_ways_then_keeps_the_faster_and_looks_again():
    from worker.engine.speculative import EXPLORE_EVERY, StepCost

    cost = StepCost(1.0)
    assert cost.allows(2)  # nothing measured at 2: with guesses first
    cost.observe(True, 6, 0.010)  # 600 tokens/s with guesses
    assert not cost.allows(2)  # then without
    cost.observe(False, 2, 0.002)  # 1000 tokens/s without: guesses do not pay here
    decisions = [cost.allows(2) for _ in range(7 * EXPLORE_EVERY)]
    # only the re-measuring steps speculate, each time the verdict stands twice as far apart
    assert [i for i, d in enumerate(decisions) if d] == [EXPLORE_EVERY - 1, 3 * EXPLORE_EVERY - 1,
                                                         7 * EXPLORE_EVERY - 1]
    assert cost.allows(1)  # another batch size is measured apart
    cost.observe(True, 3, 0.001)
    assert not cost.allows(1)
    cost.observe(False, 1, 0.001)
    assert sum(cost.allows(1) for _ in range(EXPLORE_EVERY)) == EXPLORE_EVERY - 1  # 3000 vs 1000: guesses pay
    assert cost.exploring  # the last step ran without guesses: its rate counts more
    cost.observe(False, 5, 0.001)  # plain decoding got faster: 1000 -> 2200 tokens/s
    for _ in range(8):
        cost.observe(False, 5, 0.001)
    assert not cost.allows(1) and cost.gap[1] == EXPLORE_EVERY  # the verdict flipped: looked at again soon
    off = StepCost(None)
    off.observe(True, 1, 1.0)
    assert all(off.allows(n) for n in range(1, 9))


@pytest.mark.timing  # the rule acts on measured step times: beside other workers a 1 ms step is not 1 ms
@pytest.mark.parametrize("slow_guesses", [False, True])
def test_guesses_that_make_steps_slower_turn_themselves_off(slow_guesses):
    """The null runner verifies for free; made to spend 20 ms on every step with a draft, its
    guesses cost more than they save, and speculation stops but for its re-measuring steps."""
    import time

    spec = SpeculativeConfig(method="ngram", prompt_lookup_min=1, disable_by_batch_size=None, min_accepted_tokens=0.0)
    eng = null_engine(EngineConfig(serving_tuning=ServingTuning(speculative=spec)), next_token=periodic,
                      eos_token_ids=frozenset({0}))
    real = eng.runner.execute

    def execute(sched):
        time.sleep(0.02 if slow_guesses and any(s.draft for s in sched.scheduled) else 0.001)
        return real(sched)

    eng.runner.execute = execute
    run(eng, [[3, 4, 5, 6, 8, 9, 10]], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    drafts = eng.scheduler.speculation.stats.num_drafts
    if slow_guesses:
        assert drafts <= 2 + 300 // 32, drafts  # the first measurement, then ever rarer ones
    else:
        assert drafts > 50, drafts
