"""Sampling filters on tied logits against transformers' warpers (issue 10, case 5).

Top-k and min-p must keep exactly transformers' set. Top-p must keep the same set
whenever transformers' result is well-defined; where a tie group straddles the cut,
transformers keeps a sort-order-dependent part of it and we keep all of it, so the
assertion is: ours ⊇ theirs, and ours = {tokens with logit >= the smallest logit they keep}.
"""

from __future__ import annotations

import random

import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from schemas.params import SamplingParams
from worker.engine.outputs import ScheduledRequest
from worker.model.sampler import _filter, sample


def transformers_kept(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Kept-token mask of one row `[vocab]` after transformers' warpers, in generate's order."""
    scores = x.unsqueeze(0).clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return torch.isfinite(scores[0])


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        top_k=rng.choice([0, 0, 1, 2, 3, 5, 10, 40]),
        top_p=rng.choice([1.0, rng.uniform(0.05, 0.99)]),
        min_p=rng.choice([0.0, 0.0, rng.uniform(0.01, 0.9)]),
    )


def test_filters_match_transformers_on_random_tied_logits():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 400, 40
    logits = torch.randint(-4, 5, (rows, vocab), generator=gen).float() * 0.5  # 17 values: ties everywhere
    params = [random_params(rng) for _ in range(rows)]
    ours = torch.isfinite(_filter(logits, params))  # one vectorized pass over mixed params
    num_straddled = 0
    for i, p in enumerate(params):
        theirs = transformers_kept(logits[i], p)
        assert bool((ours[i] | ~theirs).all()), (i, p)  # theirs ⊆ ours
        boundary = logits[i][theirs].min()
        assert torch.equal(ours[i], logits[i] >= boundary), (i, p)  # ours: all ties of their cut
        if p.top_p == 1.0:
            assert torch.equal(ours[i], theirs), (i, p)  # top-k and min-p: exactly transformers' set
        num_straddled += int(not torch.equal(ours[i], theirs))
    assert num_straddled > 0, "the logits must make top-p cut through a tie group"


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    kept = torch.isfinite(_filter(logits, [SamplingParams(top_k=2)]))
    assert kept.tolist() == [[True, True, True, True, False, False]]  # transformers keeps {0, 1, 2, 3}

    def draw(seed: int) -> int:
        req = ScheduledRequest("x", [1], 0, [0], True, SamplingParams(temperature=1.0, top_k=2), [1],
                               torch.Generator().manual_seed(seed))
        return sample(logits, [req])[0][0]

    assert {draw(s) for s in range(300)} == {0, 1, 2, 3}


def test_top_p_keeps_a_whole_tie_group_at_the_cut():
    # softmax([2, 1, 1, 1, 0]) = .41 .15 .15 .15 .06: mass before the tied group is .41 < .5,
    # so every token of it is kept (transformers keeps one or more of them, by sort order)
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    kept = torch.isfinite(_filter(logits, [SamplingParams(top_p=0.5)]))
    assert kept.tolist() == [[True, True, True, True, False]]
