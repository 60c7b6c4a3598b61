"""Suffix decoding's proposer (worker/engine/suffix.py): the longest matches win, the
continuation most of them share is guessed, a low share stops the guesses, finished
requests are searched across requests within a bounded cache, and an engine speculating
with it emits the tokens of one that does not."""

from __future__ import annotations

import numpy as np

from schemas.params import SamplingParams
from worker.config import EngineConfig, ServingTuning, SpeculativeConfig
from worker.engine.suffix import SuffixCache, match_length, suffix_proposal
from worker.model.null_runner import null_engine


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def test_match_length_counts_equal_tokens_backwards():
    a, b = arr(1, 2, 3, 4, 9), arr(7, 2, 3, 4)
    assert match_length(a, 4, b, 4, 10) == 3
    assert match_length(a, 4, b, 4, 2) == 2
    assert match_length(a, 0, b, 4, 10) == 0


def test_the_longest_match_decides_over_a_more_frequent_shorter_one():
    # "3 4" is followed by 5 twice, but "2 3 4" (the longer match of the end) by 8
    tokens = arr(3, 4, 5, 1, 3, 4, 5, 1, 2, 3, 4, 8, 0, 2, 3, 4)
    assert suffix_proposal(tokens, None, 2, 24, 1, 0.1) == [8]


def test_guesses_follow_the_majority_and_stop_at_a_low_share():
    # "1 2" occurs three times: followed by 7 9, 7 9 and 7 6
    tokens = arr(1, 2, 7, 9, 1, 2, 7, 9, 1, 2, 7, 6, 1, 2)
    assert suffix_proposal(tokens, None, 2, 2, 4, 0.1) == [7, 9, 1, 2]
    assert suffix_proposal(tokens, None, 2, 2, 4, 0.7) == [7]  # 1 x 2/3 < 0.7: the second guess is not made
    assert suffix_proposal(arr(1, 2, 3, 4), None, 2, 24, 4, 0.1) == []


def test_finished_requests_are_searched_and_the_cache_is_bounded():
    cache = SuffixCache(max_requests=2, min_match=2)
    cache.add([10, 11, 12, 13, 14, 15])
    assert suffix_proposal(arr(99, 11, 12), cache, 2, 24, 3, 0.1) == [13, 14, 15]
    cache.add([20, 21, 22, 23])
    cache.add([30, 31, 32, 33])  # the first is dropped, and its anchors with it
    assert len(cache) == 2
    assert suffix_proposal(arr(99, 11, 12), cache, 2, 24, 3, 0.1) == []
    assert (11, 12) not in cache.index and (31, 32) in cache.index
    empty = SuffixCache(max_requests=0, min_match=2)
    empty.add([1, 2, 3])
    assert len(empty) == 0


def suffix_engine(method: str):
    spec = SpeculativeConfig(method=method, prompt_lookup_min=2, disable_by_batch_size=None, min_accepted_tokens=0.0,
                             min_speedup=None)
    return null_engine(EngineConfig(serving_tuning=ServingTuning(speculative=spec)), eos_token_ids=frozenset({0}))


def test_a_repeated_request_is_guessed_from_the_first_ones_tokens():
    """The null runner's tokens depend on the request's tokens only: the same prompt gives
    the same output, which the second run guesses whole from the first's."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    off = suffix_engine("off")
    plain = off.generate([prompt], params)[0].token_ids
    on = suffix_engine("suffix")
    first = on.generate([prompt], params)[0].token_ids
    stats = on.scheduler.speculation.stats
    before = (stats.num_accepted_tokens, on.scheduler.step_count)
    second = on.generate([prompt], params)[0].token_ids
    assert first == second == plain
    accepted, steps = stats.num_accepted_tokens - before[0], on.scheduler.step_count - before[1]
    assert accepted >= 30 and steps <= 12, (accepted, steps)
