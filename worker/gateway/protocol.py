"""OpenAI request bodies → one `GenRequest` (a plain contract object the rest of the
gateway uses), validated at the edge.

Every top-level field of a body is one of: supported (mapped onto the job); an
extension OpenAI has no field for (`priority`, `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, vLLM's `structured_outputs`); an OpenAI field accepted only
at its no-op value (`n: 1`, `echo: false`, ...); or rejected with a 400 naming it:
OpenAI fields we do not implement ("Unsupported parameter: 'audio' ...") and fields
nobody defines ("Unrecognized request argument supplied: ..."). Nothing is silently
ignored. `null` means absent, as in OpenAI's API.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

import msgspec

from schemas.params import SamplingParams
from schemas.structured import StructuredOutputError
from schemas.structured import check as check_constraint
from schemas.wire import ChatMessage
from worker.gateway.errors import ApiError, bad_request, invalid_json, unsupported
from worker.gateway.tools import (
    ToolMode,
    reject_conflict,
    response_format,
    structured_outputs,
    tool_constraint,
)


class Kind(enum.StrEnum):
    """Which generation endpoint a request came to."""

    CHAT = "chat"
    COMPLETION = "completion"


ENDPOINT_KINDS = {"/v1/chat/completions": Kind.CHAT, "/v1/completions": Kind.COMPLETION}

_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "user",
           "safety_identifier", "service_tier", "metadata", "prompt_cache_key", "response_format", "presence_penalty",
           "frequency_penalty", "logit_bias", "n"}
EXTENSIONS = {"priority", "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "structured_outputs",
              "chat_template_kwargs"}
SUPPORTED = {
    Kind.CHAT: _COMMON | EXTENSIONS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                       "tool_choice", "parallel_tool_calls", "reasoning_effort"},
    Kind.COMPLETION: (_COMMON | EXTENSIONS | {"prompt", "logprobs"}) - {"chat_template_kwargs"},
}
# OpenAI fields accepted only at the value that changes nothing (else 400 naming them).
_NOOP: dict[Kind, dict[str, tuple[Any, ...]]] = {
    Kind.CHAT: {"functions": ([],), "function_call": ("none",), "store": (False,),
                "modalities": (["text"],)},
    Kind.COMPLETION: {"best_of": (1,), "echo": (False,), "suffix": ("",)},
}
# OpenAI fields with no no-op value here: any non-null value is a 400.
_UNSUPPORTED = {"audio", "prediction", "reasoning_effort", "reasoning", "verbosity", "web_search_options", "tools",
                "tool_choice", "parallel_tool_calls", "chat_template_kwargs"}  # (the tool fields: chat only)
MAX_CHOICES = 16  # `n`: each choice is a job of its own
_SERVICE_TIERS = {"auto": None, "default": None, "flex": "low", "priority": "high"}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False


class _Body(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None  # accepted: the prefix cache is automatic (per tenant)
    priority: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    response_format: Any = None
    structured_outputs: Any = None


class _ChatBody(_Body):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _CompletionBody(_Body):
    prompt: Any
    logprobs: int | None = None


@dataclasses.dataclass(slots=True)
class GenRequest:
    """One generation request, validated. Exactly one of `prompt`, `prompt_token_ids`,
    `messages`. `priority`: the class asked for (None: the gateway's default);
    `logprobs`: alternatives per token (None: no logprobs); `metadata` goes into the job;
    `tools` go to the chat template; `tool_mode` (set when the output is a constrained
    tool call) says how the output becomes `tool_calls`."""

    kind: Kind
    model: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    priority: str | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_mode: ToolMode | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # `reasoning_effort` goes here (templates with the knob read it)
    reasoning_first: bool = True  # the constraint leaves room for reasoning (`agents.auto_tool_calls` decides)
    n: int = 1  # choices: one job each (seeds seed, seed + 1, ... when the request has one)


def parse_request(kind: Kind, raw: bytes) -> GenRequest:
    """Decode and validate a request body.

    Raises:
        ApiError: 400 naming the field (invalid JSON, wrong type or value, unsupported
            or unknown field).
    """
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise invalid_json() from None
    return parse_body(kind, obj)


def parse_body(kind: Kind, obj: Any) -> GenRequest:
    """Validate an already decoded body (a request, or a batch line's `body`).

    Raises:
        ApiError: 400 naming the field.
    """
    if not isinstance(obj, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    obj = {k: v for k, v in obj.items() if v is not None}
    _check_fields(kind, obj)
    typed = _ChatBody if kind == Kind.CHAT else _CompletionBody
    try:
        body = msgspec.convert({k: v for k, v in obj.items() if k in SUPPORTED[kind]}, typed)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH.search(msg)
        param = m.group(1) if m else None
        raise bad_request(f"Invalid value for '{param or 'body'}': {_PATH.sub('', msg)}", param=param) from None
    req = GenRequest(kind=kind, model=body.model, params=_params(kind, body))
    if isinstance(body, _ChatBody):
        req.messages = _messages(body.messages)
        req.chat_template_kwargs = _template_kwargs(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
        req.logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        req.prompt, req.prompt_token_ids = _prompt(body.prompt)
        req.logprobs = body.logprobs
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_request("logprobs / top_logprobs must be in [0, 20].", param="top_logprobs" if kind == Kind.CHAT
                          else "logprobs")
    req.params = msgspec.structs.replace(req.params, logprobs=req.logprobs, structured=_structured(body, req))
    req.priority = _priority(body)
    if not 1 <= body.n <= MAX_CHOICES:
        raise bad_request(f"'n' must be in [1, {MAX_CHOICES}].", param="n")
    req.n = body.n
    req.stream = body.stream
    if body.stream_options is not None and not body.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    req.include_usage = bool(body.stream_options and body.stream_options.include_usage)
    meta = {"user": body.user, "safety_identifier": body.safety_identifier, "metadata": body.metadata}
    req.metadata = {k: v for k, v in meta.items() if v is not None} or None
    return req


def _structured(body: _ChatBody | _CompletionBody, req: GenRequest):
    """The constraint of `response_format`, `structured_outputs` or a forced tool call
    (at most one); sets `req.tools` and `req.tool_mode`."""
    fmt = response_format(body.response_format) if body.response_format is not None else None
    if body.structured_outputs is not None:
        if fmt is not None:
            raise bad_request("'response_format' and 'structured_outputs' cannot be combined.",
                              param="structured_outputs")
        fmt = structured_outputs(body.structured_outputs)
    param = "structured_outputs" if body.structured_outputs is not None else "response_format"
    tool = None
    if isinstance(body, _ChatBody):
        tool, req.tool_mode = tool_constraint(body.tools, body.tool_choice, body.parallel_tool_calls)
        reject_conflict(fmt is not None, tool is not None)
        req.tools = body.tools or None
    constraint = fmt or tool
    if constraint is not None:
        try:
            check_constraint(constraint)
        except StructuredOutputError as e:
            raise ApiError(400, f"Invalid {'tool parameters' if tool else param}: {e}",
                           param="tools" if tool else param, code="invalid_structured_output") from None
    return constraint


def _template_kwargs(body: _ChatBody) -> dict[str, Any] | None:
    """vLLM's `chat_template_kwargs` extension, with `reasoning_effort` added as the
    template variable of that name (templates with the knob read it; others ignore it)."""
    from schemas.wire import TEMPLATE_RESERVED

    out = dict(body.chat_template_kwargs or {})
    for k in out:
        if not k.isidentifier() or k in TEMPLATE_RESERVED:
            raise bad_request(f"'chat_template_kwargs.{k}' is not a template variable name (identifiers other than "
                              f"{sorted(TEMPLATE_RESERVED)}).", param="chat_template_kwargs")
    if body.reasoning_effort is not None:
        if body.reasoning_effort not in ("minimal", "low", "medium", "high"):
            raise bad_request("'reasoning_effort' must be one of ['high', 'low', 'medium', 'minimal'].",
                              param="reasoning_effort")
        out.setdefault("reasoning_effort", body.reasoning_effort)
    return out or None


def _check_fields(kind: Kind, obj: dict[str, Any]) -> None:
    for name, value in obj.items():
        if name in SUPPORTED[kind]:
            continue
        noop = _NOOP[kind].get(name)
        if noop is not None:
            if any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in noop):
                continue
            raise unsupported(name, _why(name))
        if name in _UNSUPPORTED or name in _NOOP[Kind.CHAT] or name in _NOOP[Kind.COMPLETION]:
            raise unsupported(name, _why(name))
        raise bad_request(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")


def _why(name: str) -> str:
    return {"best_of": " (best_of must be 1)",
            "tools": " (tool calls are on /v1/chat/completions)", "tool_choice": " (tool calls are on "
            "/v1/chat/completions)", "functions": " (deprecated: use 'tools')", "function_call": " (deprecated: use "
            "'tool_choice')",
            "echo": " (echo must be false)", "suffix": " (no suffix)"}.get(name, "")


def _params(kind: Kind, b: _ChatBody | _CompletionBody) -> SamplingParams:
    max_tokens = b.max_tokens
    if isinstance(b, _ChatBody) and b.max_completion_tokens is not None:
        if max_tokens is not None and max_tokens != b.max_completion_tokens:
            raise bad_request("'max_tokens' and 'max_completion_tokens' differ; give one.", param="max_tokens")
        max_tokens = b.max_completion_tokens
    if max_tokens is None and kind == Kind.COMPLETION:
        max_tokens = 16  # OpenAI's default for /v1/completions
    temperature = 1.0 if b.temperature is None else b.temperature
    checks = [("max_tokens", max_tokens is None or max_tokens >= 1, "must be >= 1"),
              ("temperature", 0.0 <= temperature <= 2.0, "must be in [0, 2]"),
              ("top_p", b.top_p is None or 0.0 < b.top_p <= 1.0, "must be in (0, 1]"),
              ("top_k", b.top_k is None or b.top_k >= -1, "must be >= -1 (-1 or 0 disable it)"),
              ("min_p", b.min_p is None or 0.0 <= b.min_p <= 1.0, "must be in [0, 1]"),
              ("repetition_penalty", b.repetition_penalty is None or b.repetition_penalty > 0, "must be > 0"),
              ("presence_penalty", b.presence_penalty is None or -2.0 <= b.presence_penalty <= 2.0,
               "must be in [-2, 2]"),
              ("frequency_penalty", b.frequency_penalty is None or -2.0 <= b.frequency_penalty <= 2.0,
               "must be in [-2, 2]")]
    for name, ok, rule in checks:
        if not ok:
            raise bad_request(f"'{name}' {rule}.", param=name)
    stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    if any(not s for s in stop):
        raise bad_request("'stop' must not contain empty strings.", param="stop")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=b.top_p or 1.0,
                              top_k=max(0, b.top_k or 0), min_p=b.min_p or 0.0,
                              repetition_penalty=b.repetition_penalty or 1.0,
                              presence_penalty=b.presence_penalty or 0.0, frequency_penalty=b.frequency_penalty or 0.0,
                              logit_bias=_logit_bias(b.logit_bias), stop=stop,
                              stop_token_ids=b.stop_token_ids or [], seed=b.seed, ignore_eos=b.ignore_eos)
    except ValueError as e:  # the wire contract's own checks (name the field: params.<name>)
        m = re.match(r"params\.(\w+)", str(e))
        raise bad_request(str(e).removeprefix("params."), param=m.group(1) if m else None) from None


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as JSON object keys) with integer keys; None for
    none or an empty map. Raises ApiError 400 naming `logit_bias` for a key that is not a
    token id."""
    if not raw:
        return None
    try:
        return {int(k): float(v) for k, v in raw.items()}
    except ValueError:
        raise bad_request("'logit_bias' keys must be token ids (integers as strings).", param="logit_bias") from None


def _priority(b: _Body) -> str | None:
    if b.service_tier is not None and b.service_tier not in _SERVICE_TIERS:
        raise bad_request(f"'service_tier' must be one of {sorted(_SERVICE_TIERS)}.", param="service_tier")
    tier = _SERVICE_TIERS.get(b.service_tier) if b.service_tier else None
    if tier is not None and b.priority is not None and tier != b.priority:
        raise bad_request(f"'service_tier' {b.service_tier!r} and 'priority' {b.priority!r} disagree.",
                          param="priority")
    return b.priority or tier


def _messages(raw: list[Any]) -> list[ChatMessage]:
    if not raw:
        raise bad_request("'messages' must hold at least one message.", param="messages")
    out = []
    for i, m in enumerate(raw):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{at}' must be an object.", param=at)
        role = m.get("role")
        if role == "function":
            raise unsupported(f"{at}.role", " (role 'function' is deprecated: use 'tool')")
        if role not in _ROLES:
            raise bad_request(f"'{at}.role' must be one of {sorted(_ROLES)}.", param=f"{at}.role")
        allowed = {"role", "content"} | ({"tool_calls"} if role == "assistant" else set()) | (
            {"tool_call_id", "name"} if role == "tool" else set())
        for k, v in m.items():
            if k not in allowed and v is not None and v != []:
                raise unsupported(f"{at}.{k}")
        calls = m.get("tool_calls") or None
        content = None if calls and m.get("content") is None else _content(m.get("content"), at)
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"'{at}.tool_call_id' must be the id of the call this message answers.",
                              param=f"{at}.tool_call_id")
        try:
            out.append(msgspec.convert({"role": _ROLES[role], "content": content, "tool_calls": calls,
                                        "tool_call_id": m.get("tool_call_id"), "name": m.get("name")}, ChatMessage))
        except msgspec.ValidationError as e:
            raise bad_request(f"Invalid value for '{at}': {e}", param=f"{at}.tool_calls") from None
    return out


def _content(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                raise unsupported(f"{at}.content[{j}].type", f" (content part {kind!r}: text parts only)")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"'{at}.content' must be a string or a list of text parts.", param=f"{at}.content")


def _prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """`prompt` as text or token ids; one prompt per request."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a list holding one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty.", param="prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "Several prompts in one request are not supported: send one request per prompt, "
                       "or a batch.", param="prompt", code="unsupported_parameter")
    raise bad_request("'prompt' must be a string, a list of token ids, or a list holding one of them.",
                      param="prompt")
