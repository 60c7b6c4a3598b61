"""A model runner that runs no model: for scheduler benchmarks and pure-logic tests.

It honours the runner contract (a token for every request whose chunk ends its known
tokens) and produces deterministic tokens, so everything above the model (scheduler,
KV cache manager, detokenizer, engine outputs) runs exactly as in production.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


def default_next_token(s: ScheduledRequest, vocab_size: int, avoid: frozenset[int]) -> int:
    """A deterministic function of the request's tokens so far (never a token in `avoid`)."""
    ids = s.all_token_ids
    h = (len(ids) * 1_000_003 + ids[-1] * 7919 + ids[0]) % vocab_size
    while h in avoid:
        h = (h + 1) % vocab_size
    return h


class NullRunner:
    """Drop-in for ModelRunner without a model.

    Args:
        vocab_size: token ids are drawn from `[0, vocab_size)`.
        next_token: optional `f(scheduled_request) -> token_id`; default: a hash of its tokens so far.
        avoid: token ids the default never produces (e.g. EOS, so lengths are exact).
    """

    def __init__(
        self,
        vocab_size: int,
        next_token: Callable[[ScheduledRequest], int] | None = None,
        avoid: frozenset[int] = frozenset(),
    ) -> None:
        self.device = torch.device("cpu")
        self.vocab_size = vocab_size
        self._next = next_token or (lambda s: default_next_token(s, vocab_size, avoid))

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            sampled_token_ids={s.request_id: self._next(s) for s in sched.scheduled if s.samples_token})


class LetterTokenizer:
    """Token id i decodes to one letter; enough for the detokenizer in benchmarks."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 26 for c in text]


def null_engine(
    config=None,
    *,
    vocab_size: int = 32000,
    eos_token_ids: frozenset[int] = frozenset({0}),
    max_model_len: int = 4096,
    tokenizer=None,
    next_token: Callable[[ScheduledRequest], int] | None = None,
):
    """An Engine over a NullRunner (no model, no torch compute): same scheduler, KV
    manager, detokenizer and outputs as a real engine."""
    from worker.config import EngineConfig
    from worker.engine.engine import CPU_DEFAULT_KV_TOKENS, Engine
    from worker.model.capability import KVLayout
    from worker.model.loader import LoadedModel

    config = config or EngineConfig()
    tuning = config.serving_tuning
    loaded = LoadedModel(
        model=None,
        tokenizer=tokenizer or LetterTokenizer(),
        eos_token_ids=frozenset(eos_token_ids),
        max_model_len=max_model_len,
        kv_layout=KVLayout(()),
        vocab_size=vocab_size,
        device=torch.device("cpu"),
        dtype=torch.float32,
        model_id="null",
    )
    runner = NullRunner(vocab_size, next_token, avoid=frozenset(eos_token_ids))
    num_blocks = (tuning.max_total_tokens or CPU_DEFAULT_KV_TOKENS) // tuning.kv_block_size
    return Engine(loaded, runner, config, num_blocks)
