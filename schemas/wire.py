"""Messages on Kafka and Redis (the wire contract), as msgspec Structs.

JSON on the wire; every message carries `v` (schema version). Unknown fields are
ignored so producers can add fields first; wrong types, missing required fields and
out-of-range values fail with a message naming the field (`msgspec.ValidationError`).
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Literal

import msgspec

from schemas.params import SamplingParams

SCHEMA_VERSION = 1
JOB_ID_PATTERN = r"^[A-Za-z0-9._:@/+=-]+$"
JOB_ID_MAX_LENGTH = 200
JobId = Annotated[str, msgspec.Meta(min_length=1, max_length=JOB_ID_MAX_LENGTH, pattern=JOB_ID_PATTERN)]
# A tenant is spelled like a job id without `:`: it becomes one segment of Redis keys and
# channels (`inflight:t:<tenant>:job:<id>`), and a `:` in it would let one tenant's ACL
# pattern (`inflight:t:<tenant>:job:*`) match another tenant's keys. No glob character
# (`*`, `?`, `[`, `\`) can occur either.
TENANT_PATTERN = r"^[A-Za-z0-9._@/+=-]+$"
TENANT_MAX_LENGTH = 200
TenantId = Annotated[str, msgspec.Meta(min_length=1, max_length=TENANT_MAX_LENGTH, pattern=TENANT_PATTERN)]
# A LoRA adapter is a directory name under the worker's model.lora_dir: no separators.
ADAPTER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
AdapterName = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=ADAPTER_PATTERN)]


def check_tenant(tenant: str | None) -> str | None:
    """`tenant` if it is a valid tenant id (or None).

    Raises:
        ValueError: not 1-64 characters of `A-Z a-z 0-9 . _ @ / + = -`.
    """
    if tenant is None:
        return None
    if not isinstance(tenant, str) or not 0 < len(tenant) <= TENANT_MAX_LENGTH or not re.fullmatch(
            TENANT_PATTERN, tenant):
        raise ValueError(f"tenant must be 1-{TENANT_MAX_LENGTH} characters of A-Z a-z 0-9 . _ @ / + = - "
                         f"(no ':'), got {tenant!r}")
    return tenant


class FinishReason(enum.StrEnum):
    """Why a job ended: the terminal event's `finish_reason`, the one spelling used by
    the engine, the worker, the metrics and clients.

    `stop`: EOS, a stop token or a stop string; `length`: `max_tokens` or the context;
    `cancelled`: a cancel message; `rejected`: the job can never run (invalid, too long,
    over capacity); `expired`: its `deadline` passed before it started; `error`: the
    engine failed on it (`error.code`: `oom`, `internal`, `poison`).
    """

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    EXPIRED = "expired"
    ERROR = "error"

    @property
    def is_success(self) -> bool:
        return self in (FinishReason.STOP, FinishReason.LENGTH)


FINISH_REASONS = tuple(r.value for r in FinishReason)


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


class ToolCall(msgspec.Struct, kw_only=True):
    """A call the assistant made (OpenAI's `tool_calls[]` item)."""

    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One chat message, rendered with the model's chat template. `tool_calls` on an
    assistant message and `tool_call_id` on a `tool` message (its result) carry a
    tool-calling history, as in OpenAI's API; `content` may then be null."""

    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("message `content` may be null only on an assistant message with `tool_calls`")

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (tool call arguments as objects, as
        transformers' templates expect)."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args: Any = msgspec.json.decode(c.function.arguments)
                except msgspec.DecodeError:
                    args = c.function.arguments
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


# The chat template call's own arguments and variables (transformers' apply_chat_template):
# never taken from `chat_template_kwargs`.
TEMPLATE_RESERVED = frozenset({"messages", "conversation", "tools", "documents", "chat_template",
                               "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                               "truncation", "max_length", "return_tensors", "return_dict",
                               "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
                               "raise_exception", "strftime_now"})


class Job(msgspec.Struct, kw_only=True):
    """A generation job, produced to `inflight.jobs.<priority>` keyed by `job_id`.

    Exactly one of `prompt` (text), `messages` (chat, rendered with the model's chat
    template, with `tools` when given: OpenAI function definitions, `{"type": "function",
    "function": {"name", "description", "parameters"}}`) or `prompt_token_ids`.
    `params.structured` constrains the output (JSON Schema, regex, choice, grammar).
    `deadline` and `created_at` are Unix epoch seconds;
    a job still waiting after its deadline ends as `finished(expired)`. `metadata` is
    echoed back on the `started` and `finished` events. A job with a `tenant` streams on
    `inflight:t:<tenant>:job:<id>` (and `…:log`), so Redis ACLs can confine each tenant's
    readers to its own jobs; without one, on `inflight:job:<id>`. `adapter` names a LoRA
    adapter of the worker's `model.lora_dir` (none: the base model); a name the worker
    cannot serve ends `finished(rejected)`, code `unknown_adapter` or `invalid_adapter`.
    `chat_template_kwargs` (with `messages`): extra variables of the chat template, e.g.
    `{"reasoning_effort": "low"}` or `{"enable_thinking": false}` where the template has
    such a knob (a template without it ignores them); names are identifiers other than
    the template call's own arguments (`TEMPLATE_RESERVED`). `parse_output`: the
    `finished` event also carries the answer read in the model's formats (its
    `reasoning`, the `content` around calls, and `tool_calls` when `tools` were given),
    as the gateway returns them; the worker reads the formats from the model's chat
    template (`schemas/output_formats.py`).
    """

    v: Literal[1] = 1
    job_id: JobId
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    tools: list[dict[str, Any]] | None = None
    tenant: TenantId | None = None
    deadline: float | None = None
    created_at: float | None = None
    metadata: dict[str, Any] | None = None
    adapter: AdapterName | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parse_output: bool = False

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids))
        if given != 1:
            raise ValueError("exactly one of `prompt`, `messages`, `prompt_token_ids` must be given")
        if self.tools is not None and self.messages is None:
            raise ValueError("`tools` needs `messages` (they are rendered by the chat template)")
        if self.chat_template_kwargs:
            if self.messages is None:
                raise ValueError("`chat_template_kwargs` needs `messages` (they go to the chat template)")
            bad = [k for k in self.chat_template_kwargs if not k.isidentifier() or k in TEMPLATE_RESERVED]
            if bad:
                raise ValueError(f"`chat_template_kwargs`: {bad[0]!r} is not a template variable name (identifiers "
                                 f"other than {sorted(TEMPLATE_RESERVED)})")


class Cancel(msgspec.Struct, kw_only=True):
    """Cancel request, produced to `inflight.cancel` keyed by `job_id`."""

    v: Literal[1] = 1
    job_id: JobId
    reason: str | None = None


# Dead-letter records (`inflight.dlq`) keep the original key and value bytes untouched;
# the context travels in Kafka headers with these names (as Kafka Connect's DLQ does).
DLQ_HEADER_ERROR = "inflight.error"
DLQ_HEADER_SOURCE_TOPIC = "inflight.source.topic"
DLQ_HEADER_SOURCE_PARTITION = "inflight.source.partition"
DLQ_HEADER_SOURCE_OFFSET = "inflight.source.offset"
DLQ_HEADER_JOB_ID = "inflight.job_id"
DLQ_HEADER_WORKER_ID = "inflight.worker_id"
# Machine-readable reason (`invalid_job`, an engine reject reason such as `prompt_too_long`,
# or `poison`): count dead letters by reason from the DLQ alone.
DLQ_HEADER_REASON = "inflight.reason"


# ---- events on inflight:job:{id} (pub/sub) and inflight:job:{id}:log (stream) -----------
class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


class Timings(msgspec.Struct, kw_only=True):
    """Seconds. queue: enqueue (Kafka timestamp) → first scheduled; ttft: enqueue → first
    token; tpot: mean time per output token after the first; e2e: enqueue → terminal."""

    queue_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None


class ErrorInfo(msgspec.Struct, kw_only=True):
    code: str
    message: str


class TokenLogprob(msgspec.Struct, kw_only=True, array_like=False):
    token_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class Started(msgspec.Struct, kw_only=True, tag="started", tag_field="type"):
    """The engine accepted the job (it precedes every `token`); jobs that never run get
    only `finished`."""

    v: Literal[1] = 1
    job_id: str
    seq: int
    attempt: int
    worker_id: str
    queue_time_s: float | None = None
    metadata: dict[str, Any] | None = None


class Token(msgspec.Struct, kw_only=True, tag="token", tag_field="type"):
    v: Literal[1] = 1
    job_id: str
    seq: int
    attempt: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class Restarted(msgspec.Struct, kw_only=True, tag="restarted", tag_field="type"):
    """The job is re-run from scratch; clients drop the text of earlier attempts."""

    v: Literal[1] = 1
    job_id: str
    seq: int
    attempt: int
    reason: str


class Finished(msgspec.Struct, kw_only=True, tag="finished", tag_field="type"):
    """Terminal event: exactly one per job, always last. `text` is the whole output as
    generated; for a job with `parse_output` (and a model whose chat template shows its
    formats) `content`, `reasoning` and `tool_calls` are that text read: the answer
    without reasoning and calls (None when only calls remain), the reasoning (None: none),
    the calls (None: none)."""

    v: Literal[1] = 1
    job_id: str
    seq: int
    attempt: int
    finish_reason: FinishReason
    text: str = ""
    usage: Usage | None = None
    timings: Timings | None = None
    error: ErrorInfo | None = None
    metadata: dict[str, Any] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


Event = Started | Token | Restarted | Finished
