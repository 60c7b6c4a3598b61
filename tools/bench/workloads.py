"""Seedable benchmark workloads with the length distributions of public traces.

Shapes (mean input / output tokens before `scale`):
    sharegpt     161 / 338, heavy-tailed (log-normal; vLLM paper, SOSP '23): long outputs
    alpaca        19 /  58 (vLLM paper): short prompts, short outputs
    long_prompt 1024 /  64: summarization / RAG-like, prefill-heavy
    mixed        the three interleaved 2 : 2 : 1 (sharegpt, alpaca, long_prompt)
`scale` divides the means, for CPU runs.

Prompts: with a tokenizer, real English text (the standard library's docstrings, the
same corpus the local models are trained on) encoded by the model's own tokenizer and
cut into windows of the drawn lengths; without one, uniform random token ids.
Arrivals: `poisson_arrivals` gives exponential inter-arrival gaps (seconds).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

SHAPES = {"sharegpt": (161, 338), "alpaca": (19, 58), "long_prompt": (1024, 64)}
MIXED_CYCLE = ("sharegpt", "alpaca", "sharegpt", "alpaca", "long_prompt")
KINDS = (*SHAPES, "mixed")


@dataclass(slots=True, frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    shape: str = ""


def _lognormal(rng: random.Random, mean: float, sigma: float = 1.0) -> float:
    mu = math.log(mean) - sigma**2 / 2  # so that E[X] = mean
    return rng.lognormvariate(mu, sigma)


class TextTokens:
    """A long token stream of real text encoded by `tokenizer`; `window(rng, n)` returns
    `n` consecutive tokens from a random place (the stream wraps around)."""

    def __init__(self, tokenizer, max_chars: int = 400_000) -> None:
        from tools.make_model import stdlib_docstrings

        text = "\n\n".join(stdlib_docstrings(max_chars))
        self.ids: list[int] = list(tokenizer.encode(text, add_special_tokens=False))
        if len(self.ids) < 16:
            raise ValueError("the tokenizer produced almost no tokens from the corpus")

    def window(self, rng: random.Random, n: int) -> list[int]:
        start = rng.randrange(len(self.ids))
        out = self.ids[start:start + n]
        while len(out) < n:
            out += self.ids[: n - len(out)]
        return out


def make_workload(
    kind: str, num_requests: int, *, vocab_size: int, scale: float = 1.0, seed: int = 0,
    max_input: int = 1024, max_output: int = 1024, avoid_ids: frozenset[int] = frozenset(),
    text: TextTokens | None = None,
) -> list[BenchRequest]:
    """`num_requests` requests of `kind` (see the module docstring). Token ids come from
    `text` when given, else uniform over the vocabulary except `avoid_ids` (specials).

    Raises:
        ValueError: unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"workload must be one of {sorted(KINDS)}, got {kind!r}")
    rng = random.Random(seed)
    ids = [i for i in range(vocab_size) if i not in avoid_ids]
    out = []
    for i in range(num_requests):
        shape = kind if kind != "mixed" else MIXED_CYCLE[i % len(MIXED_CYCLE)]
        mean_in, mean_out = SHAPES[shape]
        n_in = max(1, min(max_input, round(_lognormal(rng, mean_in / scale))))
        n_out = max(1, min(max_output, round(_lognormal(rng, mean_out / scale))))
        prompt = text.window(rng, n_in) if text is not None else [rng.choice(ids) for _ in range(n_in)]
        out.append(BenchRequest(f"req-{i}", prompt, n_out, shape))
    return out


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """Arrival times (seconds from 0) of `n` requests of a Poisson process of `rate`
    requests per second.

    Raises:
        ValueError: rate <= 0.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out
