"""Plain contract objects passed between the scheduler, the model runner and engine callers.

None of them hold behaviour; tests build them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from schemas.params import SamplingParams


@dataclass(slots=True, frozen=True)
class KVStats:
    """KV block counts. Invariant: free + used + cached == total."""

    total_blocks: int
    used_blocks: int  # referenced by at least one unfinished request
    free_blocks: int  # unreferenced, no cached content
    cached_blocks: int  # unreferenced, hold a reusable prefix (evictable)
    block_size: int

    @property
    def usage_ratio(self) -> float:
        """used / total, in [0, 1] (the `kv_cache_usage_ratio` gauge)."""
        return self.used_blocks / self.total_blocks


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    `token_ids` are computed at positions `start_pos … start_pos + len(token_ids) - 1`
    and their KV written through `block_ids`. When `do_sample`, the step samples the
    next token from the last position. `history` is the request's prompt + output
    (read-only; used by the repetition penalty).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    do_sample: bool
    params: SamplingParams
    history: list[int]
    generator: torch.Generator | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """The batch of one step: decodes first, then prefill chunks (packed, no padding)."""

    step: int
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    num_decodes: int  # the first `num_decodes` entries have exactly one token and start_pos > 0
    preempted_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the top alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(slots=True, frozen=True)
class RequestTimes:
    """Wall-clock timestamps (seconds since the epoch, `time.time()`) of one request.

    `arrival_time` is what the caller passed to `add_request` (the worker passes the
    Kafka record timestamp), so queue time = `first_scheduled_time - arrival_time`.
    """

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return max(0.0, self.first_scheduled_time - self.arrival_time)


@dataclass(slots=True, frozen=True)
class StepStats:
    """What one `Engine.step` did (read by the metrics on the engine thread).

    Token counts are tokens *computed* this step: a prefill chunk of a preempted request
    being recomputed counts as prefill again. `num_oom_*` and `num_internal_errors`
    count requests; `num_failed_forwards` counts forwards that raised (the batch, then
    each request retried alone that raised again), out of memory included.
    """

    step: int
    time: float  # time.time() when the step ended, seconds
    duration_s: float  # wall time of the whole step (schedule + forward + sampling + detokenize)
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    num_oom_retried: int
    num_oom_failed: int
    kv: KVStats
    num_internal_errors: int = 0  # requests ended with finish_reason error, code internal
    num_failed_forwards: int = 0


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta, not the whole text).

    `finish_reason` is set on the request's last output only, one of
    stop | length | cancelled | rejected | expired | error.
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_preemptions: int = 0
    times: RequestTimes | None = None  # set on the last output
    error_code: str | None = None  # an ErrorCode: with finish_reason "error" ("oom", "internal") or "expired"
    error_message: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """Whole result of one request, returned by `Engine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprobs] | None = None
