"""Speculative decoding's series of one worker (`serving_tuning.speculative`), part of
`Metrics` (`metrics.spec`), named after vLLM's spec-decode metrics. The acceptance rate is
`rate(spec_decode_num_accepted_tokens_total) / rate(spec_decode_num_draft_tokens_total)`,
the mean accepted length `1 + accepted / drafts`. Writer: `observe` on the engine thread
after a step; nothing is exported while speculation is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

if TYPE_CHECKING:
    from worker.engine.outputs import SpecStepStats


class SpecMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.drafts = Counter("spec_decode_num_drafts", "Drafts verified (a speculating request's step)", registry=r)
        self.draft_tokens = Counter("spec_decode_num_draft_tokens", "Tokens proposed by the drafts verified",
                                    registry=r)
        self.accepted_tokens = Counter("spec_decode_num_accepted_tokens", "Proposed tokens the verification "
                                       "accepted (each a decode step saved)", registry=r)
        self.accepted_per_pos = Counter("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens by position "
                                        "in the draft (0: the first guess)", ("position",), registry=r)

    def observe(self, s: SpecStepStats) -> None:
        if not s.num_drafts:
            return
        self.drafts.inc(s.num_drafts)
        self.draft_tokens.inc(s.num_draft_tokens)
        self.accepted_tokens.inc(s.num_accepted_tokens)
        for pos, n in enumerate(s.accepted_per_pos):
            if n:
                self.accepted_per_pos.labels(str(pos)).inc(n)
