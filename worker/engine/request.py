"""One engine request: its tokens, its progress, and its lifecycle state.

Lifecycle (an ordered enum; progress inside RUNNING is `num_computed_tokens`, the
tokens whose KV is computed or being computed by a scheduled step, as in vLLM V1):

    WAITING ──admit──► RUNNING ──finish──► FINISHED_*
       ▲                  │
       └──── PREEMPTED ◄──┘   (KV freed; recomputed from prompt + output on re-admission)

A step in flight (asynchronous steps) may still owe the request a token:
`num_output_placeholders` counts them, `num_in_flight_steps` the scheduled steps not yet
applied that hold a chunk of it.

Only the Scheduler writes `status`, `num_computed_tokens`, the token lists and the
counters of its rules (`num_preemptions`, `num_skips`, `effective_rank`, `share`).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from schemas.wire import FinishReason
from worker.engine.outputs import EngineCoreRequest, RequestOptions, TraceEvent

if TYPE_CHECKING:
    import torch

    from schemas.params import SamplingParams
    from worker.engine.speculative import SpecState
    from worker.engine.structured import Matcher


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_REJECTED = 6
    FINISHED_EXPIRED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# The one table from terminal states to the wire's `finish_reason`.
FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.CANCELLED,
    RequestStatus.FINISHED_REJECTED: FinishReason.REJECTED,
    RequestStatus.FINISHED_EXPIRED: FinishReason.EXPIRED,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Priority(enum.IntEnum):
    """Priority class; lower value is served first. Matches the Kafka topic suffixes."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @classmethod
    def parse(cls, value: Priority | str | int) -> Priority:
        if isinstance(value, Priority):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"priority must be one of ['high', 'normal', 'low'], got {value!r}") from None
        return cls(value)


class RejectReason(enum.StrEnum):
    """Why `add_request` refused a request (the wire's `error.code` for `finished(rejected)`)."""

    EMPTY_PROMPT = "empty_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt > max_input_tokens
    EXCEEDS_CONTEXT = "exceeds_context"  # prompt + max_tokens > model context
    EXCEEDS_KV_CAPACITY = "exceeds_kv_capacity"  # prompt + max_tokens > whole KV cache
    INVALID_PARAMS = "invalid_params"  # max_tokens < 1, out-of-range sampling values
    INVALID_PROMPT = "invalid_prompt"  # none or several of prompt / messages / ids; bad token ids
    INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"  # params.structured cannot be served
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    OVERLOADED = "overloaded"  # overload_policy=reject and no room now
    UNKNOWN_ADAPTER = "unknown_adapter"  # no such LoRA adapter (model.lora_dir), or none served
    INVALID_ADAPTER = "invalid_adapter"  # the adapter cannot be served on this model (adapters.py)


class ErrorCode(enum.StrEnum):
    """The wire's `error.code` of a request the engine ended after it was queued."""

    OOM = "oom"  # finished(error): out of memory in more than max_oom_retries steps
    INTERNAL = "internal"  # finished(error): its forward (alone) or its output processing raised
    DEADLINE_PASSED = "deadline_passed"  # finished(expired): still waiting at its deadline
    ADAPTER_LOAD_FAILED = "adapter_load_failed"  # finished(error): its LoRA adapter's weights did not load


class RequestRejected(Exception):
    """Raised by `Engine.add_request` when a request can never run (or, under
    `overload_policy: reject`, cannot run now). Nothing was queued."""

    def __init__(self, request_id: str, reason: RejectReason, message: str) -> None:
        super().__init__(f"request {request_id!r} rejected ({reason.value}): {message}")
        self.request_id = request_id
        self.reason = reason
        self.message = message


class Request:
    """Engine-side state of one request.

    `all_token_ids` is prompt + output in one list, so a recompute after preemption
    prefills exactly the tokens the stream has already delivered.
    """

    __slots__ = (
        "request_id",
        "params",
        "priority",
        "arrival_seq",
        "arrival_step",
        "arrival_time",
        "max_tokens",
        "eos_token_ids",
        "cache_salt",
        "tenant",
        "share",
        "status",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_in_flight_steps",
        "num_cached_tokens",
        "block_hashes",
        "effective_rank",
        "num_preemptions",
        "num_skips",
        "num_ooms",
        "first_scheduled_time",
        "first_token_time",
        "options",
        "generator",
        "end_token_ids",
        "grammar",
        "stop_in_text",
        "trace",
        "adapter",
        "lora_slot",
        "state_slot",
        "spec",
        "step_inputs",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        priority: Priority = Priority.NORMAL,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_seq: int = 0,
        arrival_step: int = 0,
        arrival_time: float = 0.0,
        cache_salt: bytes = b"",
        tenant: str = "",
        generator: torch.Generator | None = None,
        grammar: Matcher | None = None,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.arrival_seq = arrival_seq
        self.arrival_step = arrival_step
        self.arrival_time = arrival_time
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt
        self.tenant = tenant  # fair share and quotas ("": requests without a tenant)
        self.share = None  # its TenantQueue while in the scheduler (fair_share.py)
        self.generator = generator
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # tokens scheduled steps will sample, not appended yet
        self.num_in_flight_steps = 0  # scheduled steps holding a chunk of it, not applied yet
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids
        self.effective_rank = int(priority)  # rank held while running (aging applied at admission)
        self.num_preemptions = 0
        self.num_skips = 0  # admissions ranked behind it while it could not start, this wait
        self.num_ooms = 0  # steps of this request that failed with out-of-memory
        self.first_scheduled_time: float | None = None  # wall clock (s) of first admission
        self.first_token_time: float | None = None  # wall clock (s) the first output token was sampled
        self.options = RequestOptions()  # what its caller asked beyond prompt and params (outputs.py)
        stop_ids = frozenset(params.stop_token_ids)
        # every id that ends it as `stop` when sampled (EOS unless ignored, stop ids): read by `stop_status`
        # and by the update's fast path for unconstrained requests (batch.apply_batch)
        self.end_token_ids = stop_ids if params.ignore_eos else stop_ids | eos_token_ids
        self.grammar = grammar  # params.structured's state (structured.py), None if unconstrained
        self.stop_in_text = False  # ended by its grammar: the last token is part of the text
        self.adapter: str | None = None  # its LoRA adapter's name (lora_slots.py); None: the base model
        self.lora_slot = -1  # the adapter's device slot while it runs
        self.state_slot = -1  # its recurrent-state slot while it holds blocks (kv_cache.py); -1: none
        self.trace: list[TraceEvent] | None = None  # what the engine did to it, if traced; None: not traced
        self.spec: SpecState | None = None  # its speculative proposer's state, once it proposed (speculative.py)
        self.step_inputs: list | None = None  # its ScheduledRequest per step parity, reused (batch.py)

    @classmethod
    def from_core_request(cls, r: EngineCoreRequest, *, eos_token_ids: frozenset[int], arrival_seq: int,
                          generator: torch.Generator | None) -> Request:
        """The scheduler's request for a validated `EngineCoreRequest` (vLLM V1's
        `Request.from_engine_core_request`): the engine core adds its arrival order, the
        model's EOS ids and the seeded generator (None: unseeded)."""
        o = r.options
        req = cls(r.request_id, r.prompt_token_ids, r.params, max_tokens=r.max_tokens, priority=Priority(o.priority),
                  eos_token_ids=eos_token_ids, arrival_seq=arrival_seq, arrival_time=o.arrival_time,
                  cache_salt=o.cache_salt.encode(), tenant=o.tenant or "", generator=generator)
        req.options = o
        req.adapter = o.adapter
        req.trace = [] if o.traced else None
        return req

    def note(self, name: str, tokens: int = 0, reason: str = "", t: float | None = None) -> None:
        """Record a `TraceEvent` at `t` (Unix s; None: now) if the request is traced."""
        if self.trace is not None:
            self.trace.append(TraceEvent(name, time.time() if t is None else t, tokens, reason))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def stop_status(self, token_id: int) -> RequestStatus | None:
        """The finished status `token_id`, just appended, ends this request with: EOS
        (unless `ignore_eos`) or a stop token -> FINISHED_STOPPED (a stop wins over
        length); its grammar complete -> FINISHED_STOPPED with `stop_in_text`;
        `max_tokens` reached -> FINISHED_LENGTH; None if it goes on. A constrained
        request's matcher consumes the token first; a token its grammar refused (never
        sampled: the mask forbids it) -> FINISHED_ERROR."""
        grammar = self.grammar
        if grammar is not None and not grammar.accept(token_id):
            return RequestStatus.FINISHED_ERROR
        if token_id in self.end_token_ids:  # EOS unless ignored, or a stop id
            return RequestStatus.FINISHED_STOPPED
        if grammar is not None and grammar.done:
            self.stop_in_text = token_id not in self.eos_token_ids
            return RequestStatus.FINISHED_STOPPED
        if len(self.all_token_ids) - self.num_prompt_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prio={self.priority.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )

