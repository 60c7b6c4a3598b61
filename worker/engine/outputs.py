"""Plain contract objects between the layers of the engine; none hold behaviour, tests
build them by hand.

Inside the engine core (one thread): `ScheduledRequest` / `SchedulerOutput` (scheduler →
model runner), `ModelRunnerOutput` (runner → scheduler). Across the engine core's
boundary, which may be a process boundary (msgspec Structs, encoded with msgpack):
`EngineCoreRequest` (with its `RequestOptions`) in, `EngineCoreOutput` + `StepStats`
out. After output processing (detokenization, stop strings): `RequestOutput` deltas and
`CompletionOutput` results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from schemas.params import SamplingParams
from schemas.wire import FinishReason, Usage

if TYPE_CHECKING:
    import torch

    from worker.engine.structured import Matcher


class KVStats(msgspec.Struct, frozen=True):
    """KV block counts. Invariant: free + used + cached == total."""

    total_blocks: int
    used_blocks: int  # referenced by at least one unfinished request
    free_blocks: int  # unreferenced, no cached content
    cached_blocks: int  # unreferenced, hold a reusable prefix (evictable)
    block_size: int
    host_blocks: int = 0  # slots of the host-memory tier (`kv_host.py`); 0: none
    host_used_blocks: int = 0  # slots holding an evicted block

    @property
    def usage_ratio(self) -> float:
        """used / total, in [0, 1] (the `kv_cache_usage_ratio` gauge)."""
        return self.used_blocks / self.total_blocks


# ---- inside the engine core ---------------------------------------------------------------
# A decode's input token that the step launched just before it samples (asynchronous
# steps: the core schedules step N+1 while step N runs). The runner substitutes the id it
# sampled for that request in its previous step, without a round trip to the host.
PLACEHOLDER_TOKEN = -1
# Shared read-only values of the fields most steps give every request (one list fewer to
# build per request per step): never mutate them; replace the field instead.
PLACEHOLDER_INPUT: Sequence[int] = (PLACEHOLDER_TOKEN,)  # a decode's input while the step before samples it
NO_DRAFT: Sequence[int] = ()  # no guesses


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    `token_ids` are computed at positions `start_pos … start_pos + len(token_ids) - 1`
    and their KV written through `block_ids`. A decode scheduled while the step before it
    runs has `[PLACEHOLDER_TOKEN]` as its `token_ids`: its input is the token that step
    samples for it (`has_placeholder`). When `samples_token` (the chunk reaches the end
    of the request's tokens), the step samples the next token from the last position.
    `all_token_ids` is the request's prompt + output so far (read-only; the repetition
    penalty uses it); of a decode with a placeholder only the first `start_pos` entries
    are final (the token in flight may be appended while the step runs: `resolved`).
    `grammar`: its constraint's state, read (never advanced) by the runner to mask the
    row it samples. `draft`: a speculating decode's guesses d_1..d_k (`token_ids` is
    `[last token] + draft`); the step samples at each of its 1 + k positions
    (`verify_rows`) and returns the tokens its verification kept
    (`worker/engine/speculative.py`).
    """

    request_id: str
    token_ids: Sequence[int]
    start_pos: int
    block_ids: list[int]
    samples_token: bool
    params: SamplingParams
    all_token_ids: list[int]
    generator: torch.Generator | None = None
    grammar: Matcher | None = None  # its structured-output state: the sampler masks its row
    lora_slot: int = -1  # its LoRA adapter's slot (`SchedulerOutput.loras`), -1: the base model
    num_prompt_tokens: int = 0  # all_token_ids[num_prompt_tokens:] is the output (presence / frequency penalties)
    draft: Sequence[int] = NO_DRAFT  # speculative guesses verified in this step
    ahead: Sequence[int] = NO_DRAFT  # a verification row's guesses before its position
    state_slot: int = -1  # its recurrent-state slot (`worker.model.recurrent`); -1: the model keeps none

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_rows(self) -> int:
        """Rows this request samples in the step: 1 + len(draft), 0 if it samples none."""
        return 1 + len(self.draft) if self.samples_token else 0

    def verify_rows(self, with_history: bool) -> list[ScheduledRequest]:
        """A speculating decode as 1 + k one-token decodes, one per position it samples:
        row i reads `token_ids[i]` at `start_pos + i` after the guesses d_1..d_i (`ahead`:
        its grammar's mask is the state past them, `worker.model.masks`), its history
        being the request's tokens followed by them (built only `with_history`: penalties
        and the null runner read it; else every row shares the request's list)."""
        rows = []
        for i, token_id in enumerate(self.token_ids):
            history = self.all_token_ids + self.draft[:i] if with_history and i else self.all_token_ids
            rows.append(replace(self, token_ids=[token_id], start_pos=self.start_pos + i, all_token_ids=history,
                                draft=[], ahead=self.draft[:i]))
        return rows

    @property
    def has_placeholder(self) -> bool:
        return self.token_ids[-1] == PLACEHOLDER_TOKEN

    def resolved(self, token_id: int) -> ScheduledRequest:
        """This decode with its placeholder replaced by `token_id` (the token the step
        before sampled for it), `all_token_ids` a copy ending with it: the history a
        sampler reads while the step before is being applied on another thread."""
        return replace(self, token_ids=[token_id], all_token_ids=self.all_token_ids[: self.start_pos] + [token_id])


@dataclass(slots=True)
class SchedulerOutput:
    """The batch of one step: decodes first, then prefill chunks (packed, no padding).

    `requests`: the scheduler's own handles of the scheduled requests, aligned with
    `scheduled` (the update after the forward applies the step to exactly these objects,
    even if a request of the same id was added since); runners never read them.
    """

    step: int
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    num_decodes: int  # the first `num_decodes` entries have exactly one token and start_pos > 0
    requests: list[Any] = field(default_factory=list)  # engine `Request`s (request.py imports this module)
    loras: dict[int, Any] = field(default_factory=dict)  # slot -> ResidentAdapter of the requests' adapters
    num_spec_tokens: int = 0  # positions of speculating decodes (1 + k each; among the entries after the decodes)
    # host-tier block copies to run, in order, before the forward (`worker.engine.kv_host`)
    kv_copies: list[Any] = field(default_factory=list)


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probability of the sampled token and the top alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class ModelRunnerOutput:
    """A step's sampled tokens: for each request whose chunk samples, its new tokens in
    order (one; 1 to 1 + k for a speculating decode: the tokens its verification kept),
    with their logprobs where asked."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    mask_s: float = 0.0  # seconds spent computing and applying structured-output masks
    kv_copy_s: float = 0.0  # seconds spent on the step's host-tier copies (CUDA: queuing them)


@dataclass(slots=True, frozen=True)
class RunnerCapabilities:
    """What a model runner can do beyond `execute`, declared by the runner itself (the
    engine reads these, it never probes for methods).

    Attributes:
        async_launch: it has `launch` (asynchronous steps need it).
        device_time: it measures the device's busy time (`device_busy_s`); else the
            core counts its own forward wall time.
        overlaps_host: the forward thread mostly waits for a device (kernels queued, the
            GIL released in the sync), so asynchronous steps pay: the default of
            `serving_tuning.async_scheduling`.
        speculation: it verifies drafts (`ScheduledRequest.draft`), so the engine may
            propose them (`serving_tuning.speculative`).
        host_kv_slots: blocks of the host-memory KV tier it holds (`serving_tuning.host_kv_bytes`);
            it runs each step's `SchedulerOutput.kv_copies` before the step's forward. 0: none.
        state_slots: per-request recurrent-state slots it holds (`worker.model.recurrent`):
            a running request needs one (`ScheduledRequest.state_slot`), and its prefix
            cannot be shared. 0: the model keeps no such state.
    """

    async_launch: bool = False
    device_time: bool = False
    overlaps_host: bool = False
    speculation: bool = False
    host_kv_slots: int = 0
    host_kv_slot_bytes: int = 0  # bytes of one host slot (one block over every cache tensor)
    state_slots: int = 0


class Runner(Protocol):
    """What the engine core needs of a model runner (`ModelRunner`, `NullRunner`). The
    methods after `execute` exist where `capabilities` says so."""

    device: torch.device
    capabilities: RunnerCapabilities
    lora: Any  # the adapters' slots (`worker.model.lora.LoRAWeights`) when model.lora_dir is set, else None

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One forward over the packed batch; a token for every request whose chunk
        samples one. May raise (out of memory, a kernel failure): see `EngineCore.step`.
        `sched` holds no placeholder (its inputs are all known)."""
        ...

    def launch(self, sched: SchedulerOutput, after: StepHandle | None = None) -> StepHandle:
        """Where `capabilities.async_launch`: start the forward of `sched` and return
        at once. Launches run in order, each after the one before; `after` is the launch
        still in flight when `sched` was scheduled (None: none was), and a
        `PLACEHOLDER_TOKEN` input of `sched` is the token `after` samples for that
        request. If `after` raised, `sched` raises `StepSkipped` without computing
        anything (the core takes it back and recovers the failed step)."""
        ...

    def device_busy_s(self) -> float:
        """Seconds the device has spent on this runner's steps so far (monotonic): CUDA
        events on a GPU, the forward's wall time on the CPU, the queue of an emulated
        device. Where `capabilities.device_time`."""
        ...


class StepHandle(Protocol):
    """A launched step (`Runner.launch`)."""

    def result(self) -> ModelRunnerOutput:
        """Wait for the step; return its output or raise what its forward raised."""
        ...


class StepSkipped(Exception):
    """A launched step was not computed because the step launched before it raised."""


# ---- across the engine core's boundary ------------------------------------------------------
class RequestOptions(msgspec.Struct, frozen=True, array_like=True):
    """What a request asks for beyond its prompt and sampling parameters: the values that
    pass from the caller (a Kafka job: `worker.serve.starter.request_input`) to the
    scheduler's `Request.options` unchanged, across the core's boundary inside
    `EngineCoreRequest`. A new per-request field is added here (and to `request_input`
    when jobs carry it) and read where it is used; nothing between copies it. Times are
    Unix seconds (`time.time()`).

    Attributes:
        priority: a `Priority` or its name (`"high"`, `"normal"`, `"low"`); input
            processing resolves it to the `Priority` value (an int).
        tenant: whose fair share and quotas it counts against (None: the tenant `""`).
        cache_salt: keeps its prefix-cache blocks apart from other salts (the worker
            salts by tenant; input processing appends the adapter's name).
        arrival_time: when it arrived (None: now, at input processing, which sets it);
            queue time starts here (the worker passes the Kafka record's timestamp).
        deadline: a request still waiting then ends `expired` (`deadline_passed`).
        adapter: a LoRA adapter under `model.lora_dir` (None: the base model).
        traced: record `TraceEvent`s for it (its job's trace is sampled).
    """

    priority: int | str = "normal"
    tenant: str | None = None
    cache_salt: str = ""
    arrival_time: float | None = None
    deadline: float | None = None
    adapter: str | None = None
    traced: bool = False


class EngineCoreRequest(msgspec.Struct, array_like=True):
    """A validated, tokenized request (made by `InputProcessor`); `options` resolved
    (`priority` an int, `arrival_time` set)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never None here
    options: RequestOptions
    grammar: str | None = None  # params.structured as a validated llguidance grammar (structured.py)


class TraceEvent(msgspec.Struct, frozen=True, array_like=True):
    """Something the engine did to a traced request (`RequestOptions.traced`), for its
    trace (`worker.obs.tracing`): `prefill_chunk` (`tokens` computed, at the end of that
    step's forward), `preempted` (`reason`: `kv_full`, `kv_quota`, `admission`, `oom`;
    `tokens`: computed tokens dropped), `grammar_ready`. `time`: Unix seconds."""

    name: str
    time: float
    tokens: int = 0
    reason: str = ""


class RequestTimes(msgspec.Struct, frozen=True, array_like=True):
    """Wall-clock timestamps (seconds since the epoch, `time.time()`) of one request.

    `arrival_time` is what the caller passed to `add_request` (the worker passes the
    Kafka record timestamp), so queue time = `first_scheduled_time - arrival_time`.
    `events`: what the engine did to it, for a traced request only (else None).
    """

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    events: list[TraceEvent] | None = None

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return max(0.0, self.first_scheduled_time - self.arrival_time)


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """What the engine core produced for one request: new token ids (one per step; the
    outputs of consecutive steps may be merged) and, on its last output, why it ended.

    A `stop` finish decided by the core (EOS or a stop token id) means the last id ended
    the request and is not part of the text.
    """

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # aligned with new_token_ids, when asked for
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    times: RequestTimes | None = None  # on the last output
    error_code: str | None = None  # an ErrorCode value
    error_message: str | None = None
    stop_in_text: bool = False  # a `stop` by its grammar's end: the last id is part of the text


class StepStats(msgspec.Struct, frozen=True):
    """What one engine-core step did (read by the metrics).

    Token counts are tokens *computed* this step: a prefill chunk of a preempted request
    being recomputed counts as prefill again. `num_oom_*` and `num_internal_errors`
    count requests; `num_failed_forwards` counts forwards that raised (the batch, then
    each request retried alone that raised again), out of memory included.
    `duration_s` is the step's wall time; `forward_s` the part inside the model runner
    (the device's share); the difference is the engine's host time.
    """

    step: int
    time: float  # time.time() when the step ended, seconds
    duration_s: float
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
    forward_s: float = 0.0
    device_busy_s: float = 0.0  # the runner's cumulative device busy time after this step (seconds)
    # structured outputs: requests with a constraint (running or waiting for its grammar),
    # mask time of this step, grammar cache hits / misses and compile times since the last step
    num_constrained: int = 0
    mask_s: float = 0.0
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0
    grammar_compile_s: list[float] = []
    # prompt-length tiering (serving_tuning.long_prefill_threshold): long prefills given fewer
    # tokens than the step's budget allowed, and tokens spent on long prefills, this step
    num_long_prefill_capped: int = 0
    num_long_prefill_tokens: int = 0
    lora: LoRAStepStats | None = None  # LoRA adapters (model.lora_dir), None when none are served
    spec: SpecStepStats | None = None  # speculative decoding this step, None when it is off
    host_kv: HostKVStepStats | None = None  # the host-memory KV tier this step, None without one


class HostKVStepStats(msgspec.Struct, frozen=True):
    """The host-memory KV tier in one step (`serving_tuning.host_kv_bytes`): blocks and
    bytes saved to it (evicted from the device's prefix cache) and loaded from it (prefix
    hits restored instead of recomputed: each load is one block's hit), and the seconds the
    step's copies took (on CUDA: to queue them)."""

    saved_blocks: int = 0
    loaded_blocks: int = 0
    saved_bytes: int = 0
    loaded_bytes: int = 0
    copy_s: float = 0.0


class SpecStepStats(msgspec.Struct, frozen=True):
    """Speculative decoding in one step (serving_tuning.speculative; vLLM's spec-decode
    metrics): drafts verified, tokens they proposed, tokens accepted, and accepted
    tokens by position in the draft (index 0: the first guess)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []


class LoRAStepStats(msgspec.Struct, frozen=True):
    """LoRA adapters after a step: resident now (loaded, in a slot), pinned by running
    requests now; loads, evictions and failed loads since the last step, with each
    load's seconds (disk to host memory, on the loader thread)."""

    resident: int
    active: int
    loads: int = 0
    evictions: int = 0
    failures: int = 0
    load_s: list[float] = []


# ---- after output processing ------------------------------------------------------------------
@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta, not the whole text).

    `finish_reason` is set on the request's last output only.
    """

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
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
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[TokenLogprobs] | None = None
