"""Speculative decoding settings (`serving_tuning.speculative`): which proposer guesses
the next tokens and how far, and when the engine stops guessing."""

from __future__ import annotations

import msgspec

from worker.config.checks import ConfigError, one_of, positive

SPECULATIVE_METHODS = ("off", "ngram", "suffix", "draft")


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a decoding request guesses its next tokens for one forward of the model to
    verify (speculative decoding: Leviathan et al., ICML 2023; Chen et al., 2023). The
    engine's tokens are the same with it on or off (`worker/engine/speculative.py`):
    greedy requests accept a guess only where it equals the model's argmax, sampled ones
    draw each position exactly as without speculation and accept a guess only where the
    draw equals it.

    Attributes:
        method: `off`, or `ngram` (prompt lookup: the last n tokens of the request,
            n from `prompt_lookup_max` down to `prompt_lookup_min`, are looked up in its
            prompt and output so far, and the tokens that followed their latest earlier
            occurrence are proposed; vLLM's `ngram` method), or `suffix` (suffix
            decoding, Oliaro et al. 2024: the request's tokens and those of the last
            `suffix_cache_requests` finished requests are searched for the longest
            match of the request's last tokens, up to `suffix_max_depth`, and the
            guesses follow the most frequent continuation of the matches while its
            share stays above `suffix_min_token_prob`: agents and tools that repeat
            the same formats across requests), or `draft` (a small model with the same
            tokenizer, `draft_model`, guesses k tokens greedily, one forward of it per
            guess, over its own KV cache kept beside the model's in the same blocks:
            `worker/engine/draft.py`; LoRA requests draft with the base draft).
        draft_model: the draft checkpoint's directory (`method: draft` only; its
            tokenizer must be the model's). `tools/make_draft.py` distills one from a
            checkpoint.
        num_speculative_tokens: most tokens proposed per request per step (k); a step
            computes 1 + k positions for it, counted in `max_batched_tokens`.
        prompt_lookup_min, prompt_lookup_max: the shortest and longest n-gram matched
            (`suffix`: the shortest match; the longest is `suffix_max_depth`).
        suffix_max_depth: `suffix`'s longest match, in tokens.
        suffix_cache_requests: finished requests whose tokens (prompt and output)
            `suffix` searches besides the request's own, oldest dropped first (memory:
            about 100 bytes a token). 0: the request's own tokens only.
        suffix_min_token_prob: `suffix` stops guessing where the product of its
            guesses' shares among the matches' continuations falls below this.
        disable_by_batch_size: speculate only while at most this many requests run
            (vLLM's `disable_by_batch_size` idea): a full batch keeps the device busy
            without guesses, and verifying them would cost throughput. None: always.
        min_speedup: speculate at a number of running requests only while the decode
            steps there emit at least this many times the output tokens per second with
            guesses that they emit without (both measured by the engine, each re-measured
            every 32nd step; `worker/engine/speculative.py` `StepCost`): guesses that cost
            more to draft and verify than they save turn themselves off. None: no
            measuring (every step may speculate; tests that need guesses use it).
        min_accepted_tokens: a request whose drafts keep fewer guesses than this on
            average (a moving average over its drafts) stops proposing for a pause that
            doubles each time it happens again (16 steps, at most 1024), so text that
            does not repeat itself costs little after a few steps. The default is the
            break-even measured on the 2-core CPU box (drafts keeping under one guess
            made steps slower: docs/benchmarks.md); a GPU, where verifying costs less,
            would gain from a lower one (unmeasured). 0: never pause.
    """

    method: str = "off"
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 8
    min_accepted_tokens: float = 1.0
    min_speedup: float | None = 1.0
    suffix_max_depth: int = 24
    suffix_cache_requests: int = 256
    suffix_min_token_prob: float = 0.1

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def __post_init__(self) -> None:
        section = "serving_tuning.speculative"
        one_of(section, "method", self.method, SPECULATIVE_METHODS)
        positive(section, num_speculative_tokens=self.num_speculative_tokens,
                 prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max,
                 disable_by_batch_size=self.disable_by_batch_size, suffix_max_depth=self.suffix_max_depth)
        if (self.method == "draft") != (self.draft_model is not None):
            raise ConfigError(f"{section}.draft_model is the checkpoint `method: draft` guesses with: set both or "
                              f"neither (method {self.method!r}, draft_model {self.draft_model!r})")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"{section}.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                              f"{section}.prompt_lookup_max ({self.prompt_lookup_max})")
        if self.suffix_cache_requests < 0:
            raise ConfigError(f"{section}.suffix_cache_requests must be >= 0, got {self.suffix_cache_requests}")
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise ConfigError(f"{section}.suffix_min_token_prob must be in [0, 1], got {self.suffix_min_token_prob}")
        if self.min_speedup is not None and not 0.0 < self.min_speedup <= 10.0:
            raise ConfigError(f"{section}.min_speedup must be in (0, 10] or null, got {self.min_speedup}")
        if not 0.0 <= self.min_accepted_tokens < self.num_speculative_tokens:
            raise ConfigError(f"{section}.min_accepted_tokens must be in [0, num_speculative_tokens), got "
                              f"{self.min_accepted_tokens}")
