"""The Responses API's shapes (`POST /v1/responses`): a request body → the chat body the
rest of the gateway serves (one job, as for `/v1/chat/completions`), and the answer's
chat-style deltas → Responses output items and the typed stream events.

Request: `input` (text, or items: messages with text parts, `function_call`,
`function_call_output`, `reasoning` (dropped: the model reasons afresh)),
`instructions` (a system message first), function `tools` (flat, as this API spells
them) with `tool_choice` and `parallel_tool_calls`, `text.format` (`text`,
`json_object`, `json_schema`), `max_output_tokens`, `temperature`, `top_p`, `metadata`,
`user`, `store`, `previous_response_id` (its conversation goes first), `reasoning.effort`
(to the chat template, as chat's `reasoning_effort`). Accepted with no effect:
`reasoning.summary`, `include`, `truncation: "disabled"`,
`text.verbosity`, `prompt_cache_key`, `service_tier` (mapped as in chat). Refused with
a 400 naming them: built-in tools (web search, file search, computer use, code
interpreter, MCP, image generation, shell), `background: true`, `truncation: "auto"`,
image and file inputs, unknown fields.

Output items: `reasoning` (its text as `reasoning_text` content), `message`
(`output_text`), `function_call` (`call_id`, `name`, `arguments`). Stream events, each
with `sequence_number`: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, its deltas (`response.reasoning_text.delta`,
`response.content_part.added` + `response.output_text.delta`,
`response.function_call_arguments.delta`), their `.done` events and
`response.output_item.done`; last `response.completed` (or `response.incomplete` when
`max_output_tokens` cut it).
"""

from __future__ import annotations

import uuid
from typing import Any

from worker.gateway.errors import bad_request, unsupported

SUPPORTED = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
             "max_output_tokens", "temperature", "top_p", "stream", "previous_response_id", "store", "metadata",
             "user", "safety_identifier", "prompt_cache_key", "service_tier", "reasoning", "include", "truncation",
             "background", "priority", "top_k", "min_p", "repetition_penalty", "seed"}
BUILT_IN_TOOLS = {"web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter", "mcp",
                  "image_generation", "local_shell", "shell", "custom", "apply_patch"}
_ROLES = {"user", "system", "developer", "assistant"}


def new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def chat_body(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body that serves `body`; `history`: the chat messages of the
    `previous_response_id` chain (empty without one).

    Raises:
        ApiError: 400 naming the field.
    """
    for name, value in body.items():
        if name not in SUPPORTED and value is not None:
            raise bad_request(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_parameter")
    if body.get("background"):
        raise unsupported("background", " (responses run in the foreground only)")
    if body.get("truncation") not in (None, "disabled"):
        raise unsupported("truncation", " (only 'disabled': a prompt over the context is refused)")
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad_request("'instructions' must be a string.", param="instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    messages += history + input_messages(body.get("input"))
    if not messages:
        raise bad_request("'input' must hold at least one item.", param="input")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_tokens"),
                     ("metadata", "metadata"), ("user", "user"), ("safety_identifier", "safety_identifier"),
                     ("service_tier", "service_tier"), ("prompt_cache_key", "prompt_cache_key"),
                     ("parallel_tool_calls", "parallel_tool_calls"), ("priority", "priority"), ("top_k", "top_k"),
                     ("min_p", "min_p"), ("repetition_penalty", "repetition_penalty"), ("seed", "seed")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` (text or items) as chat messages; consecutive `function_call` items join
    the assistant message before them."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or a list of items.", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{at}' must be an object.", param=at)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"'{at}.role' must be one of {sorted(_ROLES)}.", param=f"{at}.role")
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), at)})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", at), "type": "function",
                    "function": {"name": _str(item, "name", at), "arguments": _str(item, "arguments", at)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", at),
                        "content": output if isinstance(output, str) else _text(output, f"{at}.output")})
        elif kind == "reasoning":
            continue  # the model's earlier reasoning is not replayed (as chat templates drop it)
        else:
            raise unsupported(f"{at}.type", f" (input item {kind!r}: messages, function_call, function_call_output, "
                              "reasoning)")
    return out


def _str(item: dict, key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"'{at}.{key}' must be a string.", param=f"{at}.{key}")
    return value


def _text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise unsupported(f"{at}.content[{j}].type", f" (content part {kind!r}: text parts only)")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"'{at}.content' must be a string or a list of text parts.", param=f"{at}.content")


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Flat function tools → chat's nested form."""
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list.", param="tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind in BUILT_IN_TOOLS:
            raise unsupported(f"tools[{i}].type", f" (built-in tool {kind!r}: function tools only)")
        if kind != "function":
            raise unsupported(f"tools[{i}].type", f" (tool type {kind!r}: function tools only)")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise unsupported("tool_choice", " ('auto', 'none', 'required' or {'type': 'function', 'name': ...})")


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object.", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise bad_request("'text.format.type' must be one of ['json_object', 'json_schema', 'text'].",
                      param="text.format.type")


# ---- the answer as output items and stream events -------------------------------------------------
class ResponseOutput:
    """Output items built from one answer's chat-style deltas (`agents.OutputParser`,
    `tools.ToolStream`, or plain `{"content": …}`); `apply` / `close` return the stream
    events they cause (without `sequence_number`, which the writer adds)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool call index -> its item

    def apply(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            return self._text("message", delta["content"] or "")
        events: list[dict[str, Any]] = []
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                events += self._close()
                item = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": fn.get("name"),
                        "arguments": "", "status": "in_progress"}
                self._calls[call["index"]] = item
                events += self._add(item)
            item = self._calls.get(call["index"])
            piece = fn.get("arguments") or ""
            if item is not None and piece:
                item["arguments"] += piece
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": self.items.index(item), "delta": piece})
        return events

    def close(self) -> list[dict[str, Any]]:
        return self._close()

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []}
                events += self._add(item)
                item["content"] = [{"type": "reasoning_text", "text": ""}]
            else:
                item = {"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                        "content": []}
                events += self._add(item)
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item["content"] = [part]
                events.append({"type": "response.content_part.added", "item_id": item["id"],
                               "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)})
        if not text:
            return events
        item["content"][0]["text"] += text
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        event = {"type": kind_event, "item_id": item["id"], "output_index": self.items.index(item),
                 "content_index": 0, "delta": text}
        if kind == "message":
            event["logprobs"] = []
        return events + [event]

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        events: list[dict[str, Any]] = []
        if item["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": item["content"][0]["text"]})
        elif item["type"] == "message":
            part = item["content"][0]
            item["status"] = "completed"
            events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": part["text"], "logprobs": []},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)}]
        else:
            item["status"] = "completed"
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        return events + [{"type": "response.output_item.done", "output_index": index, "item": dict(item)}]

    def chat_message(self) -> dict[str, Any] | None:
        """The answer as the assistant chat message the next turn replays (None: empty)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        if not text and not calls:
            return None
        return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}
