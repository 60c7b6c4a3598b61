"""Prompt-length tiering inside one engine: a per-step cap on the prefill tokens spent on
long prompts (`serving_tuning.long_prefill_threshold`, `max_long_prefill_tokens`).

Without it a long prompt's chunked prefill takes whatever budget the step has left after
the decodes, so short prompts that arrive behind it wait for its chunks: their TTFT grows
with the long prompt's length. vLLM V1 bounds the same thing per request
(`long_prefill_token_threshold`, `max_long_partial_prefills`); here the bound is per
step, over all long prefills together:

  - a request is *long* while its prefill covers more than the threshold (its prompt and,
    after a preemption, the outputs recomputed with it: `len(all_token_ids)`);
  - the prefill chunks of long requests share at most `cap` tokens per step, running
    requests' chunks first (rank order), then admissions;
  - a long request that gets nothing this step waits: a running one keeps its blocks, a
    waiting one stays in its queue without counting an admission skip, and short
    requests are admitted past it (it has the cap, in rank order, on the next step).
    Long prompts wait in their own heap in each tenant's queue (fair_share.py), so once
    the cap is spent admission passes over all of them at once, not one by one: the
    step's admission does not grow with the long backlog (`tools.bench.admission`).

So short arrivals lose at most `cap` tokens of each step to long prompts, and long
prompts still advance by `cap` tokens every step (no starvation). The scheduler
(scheduler.py) calls `start_step`, `is_long`, `chunk` and `spend`; admission
(admission.py) asks `defers` first.
"""

from __future__ import annotations

from worker.config import ServingTuning
from worker.engine.request import Request


class LongPrefillCap:
    """The step's remaining long-prefill tokens, and counters for the metrics
    (`long_prefill_capped_total`, `long_prefill_tokens_total`)."""

    def __init__(self, tuning: ServingTuning) -> None:
        self.threshold = tuning.long_prefill_threshold
        self.cap = tuning.long_prefill_cap
        self.left = self.cap
        self.num_capped_total = 0  # long prefills given fewer tokens than the step's budget allowed
        self.num_tokens_total = 0  # prefill tokens scheduled for long requests

    def start_step(self) -> None:
        self.left = self.cap

    def is_long(self, req: Request) -> bool:
        """Tiering is on and the request's prefill covers more than the threshold."""
        return self.cap is not None and len(req.all_token_ids) > self.threshold

    @property
    def is_spent(self) -> bool:
        """Tiering is on and nothing is left of this step's cap: admission passes over the
        long prompts waiting in their tenants' queues (`fair_share.ClassQueue.pick`)."""
        return self.cap is not None and self.left <= 0

    def defers(self, req: Request) -> bool:
        """`req` is long and nothing is left of this step's cap: it waits for the next step
        (counted in `num_capped_total`, as `chunk` counts a cut). For the requests admission
        still picks past a spent cap: preempted ones, which wait in their class's own heap."""
        if self.is_spent and self.is_long(req):
            self.num_capped_total += 1
            return True
        return False

    def passed_over(self, num_waiting_long: int) -> None:
        """Admission ended with budget left while the cap was spent: the `num_waiting_long`
        long prompts waiting were deferred by the cap (counted as `defers` counts one)."""
        self.num_capped_total += num_waiting_long

    def chunk(self, num_new: int) -> int:
        """A long prefill's chunk of up to `num_new` tokens under what is left of the cap
        (0: none this step)."""
        if num_new > self.left:
            self.num_capped_total += 1
            return self.left
        return num_new

    def spend(self, num_tokens: int) -> None:
        """`num_tokens` of a long prefill were scheduled."""
        self.left -= num_tokens
        self.num_tokens_total += num_tokens
