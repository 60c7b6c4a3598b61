"""Seedable benchmark workloads with the length distributions of public traces.

ShareGPT-like: heavy-tailed (log-normal) lengths, means ≈ 161 input / 338 output
tokens (vLLM paper, SOSP '23). Alpaca-like: short, ≈ 19 / 58. Mixed: half of each.
`scale` divides the means, for CPU runs.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

SHAPES = {"sharegpt": (161, 338), "alpaca": (19, 58)}


@dataclass(slots=True, frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


def _lognormal(rng: random.Random, mean: float, sigma: float = 1.0) -> float:
    mu = math.log(mean) - sigma**2 / 2  # so that E[X] = mean
    return rng.lognormvariate(mu, sigma)


def make_workload(
    kind: str, num_requests: int, *, vocab_size: int, scale: float = 1.0, seed: int = 0,
    max_input: int = 1024, max_output: int = 1024, avoid_ids: frozenset[int] = frozenset(),
) -> list[BenchRequest]:
    """`num_requests` requests of `kind` (sharegpt | alpaca | mixed); token ids uniform over
    the vocabulary except `avoid_ids` (specials)."""
    if kind not in (*SHAPES, "mixed"):
        raise ValueError(f"workload must be one of ['alpaca', 'mixed', 'sharegpt'], got {kind!r}")
    rng = random.Random(seed)
    ids = [i for i in range(vocab_size) if i not in avoid_ids]
    out = []
    for i in range(num_requests):
        shape = kind if kind != "mixed" else ("sharegpt" if i % 2 == 0 else "alpaca")
        mean_in, mean_out = SHAPES[shape]
        n_in = max(1, min(max_input, round(_lognormal(rng, mean_in / scale))))
        n_out = max(1, min(max_output, round(_lognormal(rng, mean_out / scale))))
        out.append(BenchRequest(f"req-{i}", [rng.choice(ids) for _ in range(n_in)], n_out))
    return out
