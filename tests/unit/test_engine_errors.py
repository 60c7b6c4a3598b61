"""Engine error paths over a NullRunner (issue 10, case 3): a forward or an output that
raises ends only the request it belongs to, once, with `finished(error, internal)`."""

from __future__ import annotations

import pytest

from schemas.params import SamplingParams
from worker.config import EngineConfig, ServingTuning
from worker.engine import StepStats
from worker.model.null_runner import LetterTokenizer, default_next_token, null_engine
from worker.obs.metrics import Metrics

BAD = 13  # the token id the broken tokenizer / runner chokes on


class BrokenTokenizer(LetterTokenizer):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if BAD in ids:
            raise ValueError(f"cannot decode {BAD}\nmore detail")
        return super().decode(ids, skip_special_tokens)


def scripted(by_prompt: dict[int, list[int]]):
    """Output i of the request whose prompt starts with p is by_prompt[p][i]."""

    def next_token(s):
        return by_prompt[s.all_token_ids[0]][len(s.all_token_ids) - 3]

    return next_token


def make(**kw):
    tuning = ServingTuning(max_total_tokens=256, kv_block_size=4, max_batched_tokens=64)
    return null_engine(EngineConfig(serving_tuning=tuning), vocab_size=100, **kw)


def run(eng, m: Metrics):
    finals: dict[str, list] = {}
    toks: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finals.setdefault(o.request_id, []).append(o)
        m.observe_step(eng.last_step_stats)
        eng.check_invariants()
    return finals, toks


@pytest.mark.parametrize("bad_at", [1, 3])  # mid-stream, and the max_tokens-th (last) token
def test_output_that_cannot_be_decoded_ends_only_its_request(bad_at):
    bad_tokens = [20, 21, 22]
    bad_tokens[bad_at - 1] = BAD
    eng = make(tokenizer=BrokenTokenizer(), next_token=scripted({1: bad_tokens, 2: [20, 21, 22, 23]}))
    m = Metrics()
    eng.add_request("bad", prompt_token_ids=[1, 1, 1], params=SamplingParams(max_tokens=3))
    eng.add_request("good", prompt_token_ids=[2, 2, 2], params=SamplingParams(max_tokens=4))
    finals, toks = run(eng, m)
    assert all(len(f) == 1 for f in finals.values()) and set(finals) == {"bad", "good"}
    bad = finals["bad"][0]
    assert bad.finish_reason == "error" and bad.error_code == "internal"  # not "length", though it was the last
    assert bad.error_message == f"ValueError: cannot decode {BAD}"
    assert toks["bad"] == bad_tokens[:bad_at] and bad.usage.completion_tokens == bad_at
    assert finals["good"][0].finish_reason == "length" and toks["good"] == [20, 21, 22, 23]
    assert m.registry.get_sample_value("request_errors_total", {"code": "internal"}) == 1
    assert eng.kv_stats().used_blocks == 0


def test_runner_that_raises_on_one_request_fails_it_alone():
    def next_token(s):
        if s.all_token_ids[0] == BAD:
            raise IndexError("index 70000 is out of bounds for dimension 0 with size 100")
        return default_next_token(s, 100, frozenset({0}))

    eng = make(next_token=next_token)
    m = Metrics()
    for rid, first in (("n1", 2), ("poison", BAD), ("n2", 3)):
        eng.add_request(rid, prompt_token_ids=[first, 5, 6], params=SamplingParams(max_tokens=5, ignore_eos=True))
    finals, toks = run(eng, m)
    assert finals["poison"][0].error_code == "internal" and toks.get("poison", []) == []
    assert [finals[r][0].finish_reason for r in ("n1", "n2")] == ["length", "length"]
    assert len(toks["n1"]) == len(toks["n2"]) == 5
    assert m.registry.get_sample_value("engine_failed_forwards_total") == 2  # the batch, then the poison alone
    assert eng.kv_stats().used_blocks == 0


def test_step_stats_fields_default_to_zero_and_feed_the_counters():
    from worker.engine import KVStats

    kv = KVStats(total_blocks=4, used_blocks=0, free_blocks=4, cached_blocks=0, block_size=16)
    s = StepStats(step=1, time=0.0, duration_s=0.0, num_running=0, num_waiting=0, num_prefill_tokens=0,
                  num_decode_tokens=0, num_preemptions=0, num_oom_retried=0, num_oom_failed=2, kv=kv,
                  num_internal_errors=3, num_failed_forwards=4)
    m = Metrics()
    m.observe_step(s)
    get = m.registry.get_sample_value
    assert get("request_errors_total", {"code": "internal"}) == 3 and get("request_errors_total", {"code": "oom"}) == 2
    assert get("engine_failed_forwards_total") == 4
