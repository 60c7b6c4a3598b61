"""OpenAI `response_format`, `tools` / `tool_choice` (and vLLM's `structured_outputs`
extension) → one `params.structured` constraint, and the constrained output back as
OpenAI `tool_calls`.

Tool calls are constrained, not parsed from free text:
  - `tool_choice: {"type": "function", "function": {"name": N}}`: the output is N's
    arguments, a JSON object valid against its `parameters`; one call.
  - `tool_choice: "required"`: the output is a JSON array of `{"name", "parameters"}`
    objects, each naming one of `tools` with arguments valid against that tool's
    `parameters` (one item when `parallel_tool_calls` is false), as vLLM's
    `required` mode; one call per item.
  - `tool_choice: "none"`: plain text (the tools still reach the chat template).
  - `tool_choice: "auto"` (OpenAI's default when `tools` are given): the model decides;
    its calls are read from its text in its family's format (`worker/gateway/agents.py`),
    and with `gateway.constrained_tool_calls` a call it opens is held to the schemas.
Named and `required` outputs are always constrained. `strict` of a `json_schema`
response format, unless it is `false`, also closes every object the schema leaves open
(`additionalProperties: false`, as OpenAI's strict mode requires of the schema and
xgrammar assumes); function parameters are always closed that way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from schemas.params import (
    ChoiceOutput,
    GrammarOutput,
    JsonObjectOutput,
    JsonSchemaOutput,
    RegexOutput,
    StructuredOutput,
)
from schemas.tool_parsers import ToolCallStream, call_id
from worker.gateway.errors import ApiError, bad_request, unsupported

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclasses.dataclass(slots=True, frozen=True)
class ToolMode:
    """How an output becomes `tool_calls`: `name` for a named function (the output is
    its arguments), None for `required` (the output is an array of calls); `auto`: the
    calls are parsed from free text (`functions`: name -> parameters schema, for the
    constrained-auto grammar; `parallel`: more than one call allowed)."""

    name: str | None = None
    auto: bool = False
    functions: dict[str, Any] | None = None
    parallel: bool = True


def response_format(value: Any) -> StructuredOutput | None:
    """`response_format` → constraint (None for `text`).

    Raises:
        ApiError: 400 naming the field.
    """
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'.", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonObjectOutput()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad_request("'response_format.json_schema' must be an object with a 'name' and a 'schema'.",
                              param="response_format.json_schema")
        schema = spec.get("schema", ANY_OBJECT)
        if not isinstance(schema, dict):
            raise bad_request("'response_format.json_schema.schema' must be a JSON Schema object.",
                              param="response_format.json_schema.schema")
        return JsonSchemaOutput(schema=schema, strict=spec.get("strict") is not False)
    raise bad_request(f"'response_format.type' must be one of ['json_object', 'json_schema', 'text'], got {kind!r}.",
                      param="response_format.type")


def structured_outputs(value: Any) -> StructuredOutput:
    """vLLM's `structured_outputs` extension (`{"json": schema}`, `{"regex": ...}`,
    `{"choice": [...]}`, `{"grammar": ...}`, `{"json_object": true}`; exactly one).

    Raises:
        ApiError: 400 naming the field.
    """
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be an object.", param=param)
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    makers = {"json": lambda v: JsonSchemaOutput(schema=msgspec.json.decode(v) if isinstance(v, str) else v),
              "json_object": lambda v: JsonObjectOutput(), "regex": lambda v: RegexOutput(pattern=v),
              "choice": lambda v: ChoiceOutput(choices=v), "grammar": lambda v: GrammarOutput(grammar=v)}
    unknown = sorted(set(given) - set(makers))
    if unknown:
        raise unsupported(f"{param}.{unknown[0]}", f" (supported: {sorted(makers)})")
    if len(given) != 1:
        raise bad_request(f"'{param}' must hold exactly one of {sorted(makers)}.", param=param)
    (key, v), = given.items()
    try:
        return makers[key](v)
    except (ValueError, TypeError, msgspec.ValidationError, msgspec.DecodeError) as e:
        raise bad_request(f"Invalid value for '{param}.{key}': {str(e).removeprefix('params.structured.')}",
                          param=f"{param}.{key}") from None


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each `tools` entry."""
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list.", param="tools")
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise unsupported(f"{at}.type", f" (tool type {kind!r}: function tools only)")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"'{at}.function' must be an object with a 'name'.", param=f"{at}.function")
        params = fn.get("parameters") or ANY_OBJECT
        if not isinstance(params, dict):
            raise bad_request(f"'{at}.function.parameters' must be a JSON Schema object.",
                              param=f"{at}.function.parameters")
        if fn["name"] in out:
            raise bad_request(f"'{at}.function.name' {fn['name']!r} is given twice.", param=f"{at}.function.name")
        out[fn["name"]] = params
    return out


def tool_constraint(tools: Any, tool_choice: Any, parallel: bool | None) -> tuple[StructuredOutput | None,
                                                                                   ToolMode | None]:
    """(`tools`, `tool_choice`, `parallel_tool_calls`) → (constraint, how to read the output).
    No tools, or `tool_choice: "none"`: (None, None); "auto": (None, an auto mode) — the
    gateway adds the model family's grammar (`agents.auto_tool_calls`).

    Raises:
        ApiError: 400 naming the field (an unknown function, a malformed tool).
    """
    functions = _functions(tools) if tools else {}
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return None, None
    if not functions:
        raise bad_request("'tool_choice' needs 'tools'.", param="tool_choice")
    if tool_choice == "auto":
        return None, ToolMode(auto=True, functions=functions, parallel=parallel is not False)
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if parallel is False:
            schema["maxItems"] = 1
        return JsonSchemaOutput(schema=schema), ToolMode(None)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise bad_request(f"'tool_choice.function.name' {name!r} is not one of the tools {sorted(functions)}.",
                              param="tool_choice.function.name")
        return JsonSchemaOutput(schema=functions[name]), ToolMode(name)
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}.", param="tool_choice")


def tool_calls(mode: ToolMode, text: str) -> list[dict[str, Any]] | None:
    """The OpenAI `tool_calls` of a constrained output, or None if the text is not a
    complete call (a `length` finish cut it)."""
    if mode.name is not None:
        return [{"id": call_id(), "type": "function", "function": {"name": mode.name, "arguments": text}}]
    try:
        items = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None
    return [{"id": call_id(), "type": "function",
             "function": {"name": it["name"], "arguments": msgspec.json.encode(it["parameters"]).decode()}}
            for it in items]


def chat_deltas(events: list[tuple]) -> list[dict[str, Any]]:
    """`schemas.tool_parsers.ToolCallStream` events as OpenAI chat deltas: text as
    `content`; a call's first delta with its id and name, then its argument pieces (a
    call that broke after it opened stays as sent)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if e[0] == "content":
            out.append({"content": e[1]})
        elif e[0] == "call":
            out.append({"tool_calls": [{"index": e[1], "id": e[2], "type": "function",
                                        "function": {"name": e[3], "arguments": ""}}]})
        elif e[0] == "args":
            out.append({"tool_calls": [{"index": e[1], "function": {"arguments": e[2]}}]})
    return out


class ToolStream:
    """Streamed `delta.tool_calls` of one response, as the arguments are generated (the
    first delta of a call carries its id and name): a named call's output is its
    arguments; a `required` output, a JSON array of `{"name", "parameters"}` items, is
    read item by item as it grows (`schemas.tool_parsers`, the array form), so each call
    opens once its name is complete, and calls already complete stream even when
    `max_tokens` cuts a later one."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self._opened = False
        self._array: ToolCallStream | None = None
        if mode.name is None:
            self._array = ToolCallStream("mistral")  # `[TOOL_CALLS][{…}, …]`: the same array, after its opener
            self._array.feed("[TOOL_CALLS]")

    def text(self, piece: str) -> list[dict[str, Any]]:
        """Deltas for newly generated text (JSON fragments)."""
        if self._array is not None:
            return [d for d in chat_deltas(self._array.feed(piece)) if "tool_calls" in d]
        if not self._opened:
            self._opened = True
            return [{"tool_calls": [{"index": 0, "id": call_id(), "type": "function",
                                     "function": {"name": self.mode.name, "arguments": piece}}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}] if piece else []

    def finish(self) -> list[dict[str, Any]]:
        """Deltas once the output ended."""
        if self._array is not None:
            return [d for d in chat_deltas(self._array.finish()) if "tool_calls" in d]
        return [] if self._opened else self.text("")


def finish_reason(mode: ToolMode | None, reason: str) -> str:
    """OpenAI's `tool_calls` finish for a completed call."""
    return "tool_calls" if mode is not None and reason == "stop" else reason


def reject_conflict(has_format: bool, has_tools: bool) -> None:
    if has_format and has_tools:
        raise ApiError(400, "'response_format' and a tool call ('tool_choice' 'required' or named) cannot be "
                       "combined: both constrain the output.", param="response_format", code="invalid_request_error")
