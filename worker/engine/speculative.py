"""Speculative decoding in the continuous batch: a proposer guesses up to k tokens for a
decoding request, one forward verifies them, and every accepted guess is a decode step
saved (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding",
ICML 2023; Chen et al., "Accelerating LLM Decoding with Speculative Sampling", 2023;
the proposers: prompt lookup decoding, Saxena 2023, vLLM's `ngram` method, here; suffix
decoding across requests in suffix.py).

A request of context L (its last token not yet computed) with a draft d_1..d_k is
scheduled as one chunk of 1 + k tokens, [t_L, d_1, ..., d_k] at positions L-1 .. L-1+k,
and the step samples a token at each of the 1 + k positions (`ScheduledRequest.draft`):
x_0 from the true context, x_i from the context extended by d_1..d_i. The output is
x_0 .. x_a where a is the number of leading positions with x_i == d_{i+1}
(`num_accepted`): each x_i is what the request would sample at that point without
speculation, and only positions whose context holds accepted guesses alone are kept.
So the tokens are the same as without speculation, not just the distribution:
  - greedy rows: x_i is the argmax (the longest prefix equal to the target's argmax);
  - sampled rows: x_i is the exponential race of the sampler with the request's own
    noise; a seeded request's generator is wound back to just after draw a
    (`worker/model/sampler.py`), so it draws exactly as many noise vectors as tokens it
    keeps. For a guess d this accepts with probability p(d) and otherwise yields a token
    of p with d removed, renormalized: rejection sampling for a one-point draft
    (the rule of the papers above with q = 1 at d).
The KV written at the rejected positions is never read: progress rolls back to
L + a (`batch.apply_batch`), the next step overwrites those slots, and prefix-cache
hashes are taken over accepted tokens only.

A request with a grammar (structured outputs) guesses only what its grammar allows from
its state (the draft is cut at the first refused guess), and each verified position is
masked by the grammar advanced through the guesses before it (then rolled back:
`worker/model/masks.py`); only kept tokens advance it for good.

Not speculated (their step is an ordinary decode): the last token of `max_tokens`,
sliding-window models, and every request while more than `disable_by_batch_size` run.
Steps are sequential while speculation is on (the engine core turns `async_scheduling`
off): a draft is proposed from the request's known tokens, and the step behind a
speculating one cannot know where the request will stand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from worker.config.speculative import SpeculativeConfig
from worker.engine.outputs import SpecStepStats
from worker.engine.suffix import SuffixCache, suffix_proposal

log = logging.getLogger(__name__)

# `method: draft`: the guesses of a scheduled draft are this until the draft model fills
# them in, after the step is scheduled and before its forward (worker/engine/draft.py)
DRAFT_PENDING = -2
PAUSE_STEPS = 16  # a request's first pause after its drafts' kept guesses fell below the floor
MAX_PAUSE_STEPS = 1024
EWMA_WEIGHT = 0.25  # weight of the newest draft in a request's moving average of kept guesses
EXPLORE_EVERY = 32  # StepCost: steps at a batch size before one runs the other way (doubling)
MAX_EXPLORE_EVERY = 1024
COST_EWMA_WEIGHT = 0.1  # StepCost: weight of the newest step in a rate's moving average
EXPLORE_EWMA_WEIGHT = 0.3  # ... of a step run the other way


def num_accepted(sampled: list[int], draft: list[int]) -> int:
    """How many leading guesses of `draft` (d_1..d_k) the step's samples `sampled`
    (x_0..x_k, or at least the first len(draft) of them) confirm: the largest a with
    x_i == d_{i+1} for every i < a."""
    a = 0
    for x, d in zip(sampled, draft):
        if x != d:
            break
        a += 1
    return a


def ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup: the up to `k` tokens that followed the latest earlier occurrence of
    the longest suffix of `tokens` (n from `max_n` down to `min_n` tokens) in `tokens`;
    [] when no suffix of `min_n` tokens occurred before.

    Args:
        tokens: `[num_tokens]` the request's prompt + output so far (int).
    """
    n_tok = len(tokens)
    if n_tok < min_n + 1:
        return []
    # candidates j: the position where an earlier occurrence of the suffix ends (j < n_tok - 1)
    cand = np.flatnonzero(tokens[:-1] == tokens[-1])
    length = 1
    while length < max_n and cand.size:
        room = cand[cand >= length]
        longer = room[tokens[room - length] == tokens[n_tok - 1 - length]]
        if not longer.size:
            break
        cand = longer
        length += 1
    if length < min_n or not cand.size:
        return []
    j = int(cand[-1])  # the latest occurrence
    return tokens[j + 1: j + 1 + k].tolist()


@dataclass(slots=True)
class SpecState:
    """One request's proposer state: its tokens as an array (grown as they are
    appended), its drafts' kept guesses (a moving average) and its pause."""

    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    num_tokens: int = 0
    kept: float = float("inf")  # moving average of the guesses its drafts kept (inf: no draft yet)
    paused_until: int = 0  # the scheduler step from which it proposes again
    pause: int = PAUSE_STEPS  # its next pause's length
    # `method: draft` (draft.py): positions [0, draft_valid) of the draft model's KV hold the
    # request's tokens; `draft_fed` the guesses it was fed after them (valid where they
    # were kept); `draft_preemptions` the request's preemptions then (a preemption frees them)
    draft_valid: int = 0
    draft_fed: list[int] = field(default_factory=list)
    draft_preemptions: int = 0

    def sync(self, all_token_ids: list[int]) -> np.ndarray:
        """The token array brought up to `all_token_ids` (appends only; amortized O(new))."""
        n = len(all_token_ids)
        if n > len(self.tokens):
            grown = np.empty(max(2 * len(self.tokens), n + 64), dtype=np.int64)
            grown[: self.num_tokens] = self.tokens[: self.num_tokens]
            self.tokens = grown
        if n > self.num_tokens:
            self.tokens[self.num_tokens: n] = all_token_ids[self.num_tokens: n]
        self.num_tokens = n
        return self.tokens[:n]


@dataclass(slots=True)
class SpecStats:
    """Counters since the engine started (vLLM's spec-decode metrics): drafts proposed,
    tokens proposed, tokens accepted, and accepted tokens by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def copy(self) -> SpecStats:
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_pos))

    def since(self, before: SpecStats) -> SpecStepStats:
        """What was counted after `before` (a `copy` of these counters)."""
        return SpecStepStats(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                             self.num_accepted_tokens - before.num_accepted_tokens,
                             [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)])


class StepCost:
    """The adaptive rule's measured half: whether guesses pay at a batch size, from the
    steps themselves (what drafting and verifying cost against what they save, on this
    device, for this model and proposer).

    Per number of running requests R: a moving average of the output tokens per second
    of decode-only steps (no prefill chunk) with guesses, and of those without. A step
    at R speculates while the rate with guesses is at least `min_speedup` x the rate
    without. Each way is measured first; then a step at R runs the other way after
    EXPLORE_EVERY steps, then after twice as many each time the verdict stands (up to
    MAX_EXPLORE_EVERY), and after EXPLORE_EVERY again once it flips: a change (longer
    contexts, a proposer doing better) is seen, and a way that keeps losing costs less
    and less. None: the rule is off (every step may speculate).
    """

    def __init__(self, min_speedup: float | None) -> None:
        self.min_speedup = min_speedup
        self.rates: dict[tuple[int, bool], float] = {}  # (R, with guesses) -> tokens/s (moving average)
        self.verdict: dict[int, bool] = {}  # R -> whether guesses paid at the last decision
        self.since: dict[int, int] = {}  # R -> decisions since its last step the other way
        self.gap: dict[int, int] = {}  # R -> decisions until its next step the other way
        self.batch: int | None = None  # R of the step being decided (None: not speculating by batch size)
        self.exploring = False  # the step being decided runs the way the verdict does not choose

    def allows(self, num_running: int) -> bool:
        self.batch, self.exploring = num_running, False
        if self.min_speedup is None:
            return True
        with_, without = self.rates.get((num_running, True)), self.rates.get((num_running, False))
        if with_ is None or without is None:
            return with_ is None  # measure with guesses first, then without
        pays = with_ >= self.min_speedup * without
        if self.verdict.get(num_running) != pays:
            log.info("speculative decoding %s at %d running: decode steps give %.0f tokens/s with guesses, %.0f "
                     "without (min_speedup %.2f)", "on" if pays else "off", num_running, with_, without,
                     self.min_speedup)
            if num_running in self.verdict:
                self.gap[num_running] = EXPLORE_EVERY  # the verdict flipped: look again soon
        self.verdict[num_running] = pays
        n = self.since[num_running] = self.since.get(num_running, 0) + 1
        gap = self.gap.get(num_running, EXPLORE_EVERY)
        if n < gap:
            return pays
        self.since[num_running], self.gap[num_running] = 0, min(2 * gap, MAX_EXPLORE_EVERY)
        self.exploring = True
        return not pays

    def observe(self, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A decode-only step of the batch just decided: `num_tokens` output tokens in
        `seconds` of step (schedule, guesses, forward, update), with guesses or not."""
        if self.batch is None or seconds <= 0:
            return
        key = (self.batch, speculated)
        rate = num_tokens / seconds
        old = self.rates.get(key)
        weight = EXPLORE_EWMA_WEIGHT if self.exploring else COST_EWMA_WEIGHT  # a rare sample says more
        self.rates[key] = rate if old is None else old + weight * (rate - old)


class Speculation:
    """The scheduler's proposer: decides per step whether to speculate, proposes a
    request's draft, and learns from what its verification accepted.

    Args:
        config: `serving_tuning.speculative` (must be enabled).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self.cost = StepCost(config.min_speedup)
        # suffix decoding's tokens of recently finished requests (suffix.py)
        self.cache = (SuffixCache(config.suffix_cache_requests, config.prompt_lookup_min)
                      if config.method == "suffix" else None)

    def active(self, num_running: int) -> bool:
        """Whether this step speculates at all: the batch-size rule, then the step-cost
        rule (`StepCost`)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            self.cost.batch = None
            return False
        return self.cost.allows(num_running)

    def propose(self, req, step: int, max_new: int) -> list[int]:
        """A draft for decoding request `req` (a scheduler `Request`) of at most `max_new`
        tokens (the step's budget left, minus its own token); [] when it does not
        speculate now (see the module docstring)."""
        grammar = req.grammar
        if grammar is not None and grammar.done:
            return []
        k = min(self.k, max_new, req.max_tokens - req.num_output_tokens - 1)
        if k <= 0:
            return []
        state = req.spec
        if state is None:
            state = req.spec = SpecState()
        elif step < state.paused_until:
            return []
        cfg = self.config
        if cfg.method == "draft":  # guessed by the draft model once the step is scheduled
            return [DRAFT_PENDING] * k
        tokens = state.sync(req.all_token_ids)
        if cfg.method == "suffix":
            draft = suffix_proposal(tokens, self.cache, cfg.prompt_lookup_min, cfg.suffix_max_depth, k,
                                    cfg.suffix_min_token_prob)
        else:
            draft = ngram_proposal(tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max, k)
        if grammar is not None and draft:  # up to the first guess the grammar refuses
            draft = draft[: grammar.raw.validate_tokens(draft)]
        return draft

    def finished(self, req) -> None:
        """A request left the scheduler: suffix decoding caches its tokens if it produced any."""
        if self.cache is not None and req.num_output_tokens > 0:
            self.cache.add(req.all_token_ids)

    def verified(self, req, num_proposed: int, num_accepted_: int, step: int) -> None:
        """Record a verified draft of `req`: the counters, its moving average of kept
        guesses, and a pause when that average is below `min_accepted_tokens`."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted_
        for i in range(num_accepted_):
            stats.accepted_per_pos[i] += 1
        state = req.spec
        if state is None:  # a draft from elsewhere than `propose` (tests force them)
            state = req.spec = SpecState()
        floor = self.config.min_accepted_tokens
        if state.kept == float("inf"):
            state.kept = float(self.k)  # optimistic start: a few drafts decide
        state.kept += EWMA_WEIGHT * (num_accepted_ - state.kept)
        if state.kept < floor:
            state.paused_until = step + state.pause
            state.pause = min(2 * state.pause, MAX_PAUSE_STEPS)
            state.kept = floor  # it resumes on probation
        elif state.kept >= 2 * floor:
            state.pause = PAUSE_STEPS
