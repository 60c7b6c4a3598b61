"""The sampler's exponential race noise (`worker.model.sampler._exponential`): Exp(1) draws
never 0, from the row's own generator (a seed gives the same draws), with the moments and
tail of Exp(1); and a sampled row's tokens follow softmax of its logits over a wide
vocabulary (a chi-square test: 4000 draws, 7 bins, false-alarm rate 1e-4)."""

from __future__ import annotations

import math

import torch

from schemas.params import SamplingParams
from worker.model.sampler import _draw, _exponential


def test_draws_are_exp1_never_0_and_follow_their_generator():
    x = _exponential(torch.empty(2_000_000), torch.Generator().manual_seed(5))
    assert bool((x > 0).all()) and bool(torch.isfinite(x).all())
    # mean and variance 1; standard errors 0.0007 and 0.002 at this size: 6 sigma margins
    assert abs(x.mean().item() - 1.0) < 0.005 and abs(x.var().item() - 1.0) < 0.015
    for t in (0.1, 1.0, 3.0, 6.0):  # P(E > t) = e^-t
        assert abs((x > t).float().mean().item() - math.exp(-t)) < 6 * math.sqrt(math.exp(-t) / 2e6) + 1e-6
    a = _exponential(torch.empty(64), torch.Generator().manual_seed(9))
    b = _exponential(torch.empty(64), torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


class _Row:  # what `_draw` reads of a scheduled request
    def __init__(self, generator):
        self.generator = generator


def test_a_sampled_row_follows_softmax_over_a_wide_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(1, 2048) * 3
    probs = torch.softmax(logits[0], 0).double()
    order = probs.argsort(descending=True)
    bins = [order[:1], order[1:2], order[2:4], order[4:8], order[8:16], order[16:64], order[64:]]
    want = [probs[b].sum().item() for b in bins]
    gen = torch.Generator().manual_seed(1)
    n = 4000
    draws = torch.tensor([int(_draw(logits, [_Row(gen)], [SamplingParams(temperature=1.0)])[0]) for _ in range(n)])
    got = [int(torch.isin(draws, b).sum()) for b in bins]
    chi2 = sum((g - n * w) ** 2 / (n * w) for g, w in zip(got, want) if n * w > 0)
    assert chi2 < 27.9, (got, [round(n * w) for w in want])  # chi-square, 6 degrees of freedom, p = 1e-4
