"""OpenAI response objects built from a job's events: `chat.completion` /
`text_completion` bodies, their streamed chunks as server-sent events (`data: {...}`,
`data: [DONE]` last), usage, and logprobs in each endpoint's shape (chat:
`{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`; completions:
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`).

Logprob tokens are shown as text when the gateway has the model's tokenizer
(`gateway.tokenizer`), else as `token_id:<id>` (vLLM's `--return-tokens-as-token-ids`).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from schemas.wire import Finished, TokenLogprob, Usage
from worker.gateway.agents import OutputParser
from worker.gateway.errors import ApiError
from worker.gateway.protocol import Kind
from worker.gateway.tools import ToolMode, ToolStream, finish_reason, tool_calls

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + _encode(obj) + b"\n\n"


class TokenText:
    """Token id → text for logprobs. Args: path: a `tokenizer.json` or a directory holding
    one (None: ids spelled `token_id:<id>`).

    Raises:
        ConfigError: the tokenizer cannot be loaded (names `gateway.tokenizer`).
    """

    def __init__(self, path: str | None = None) -> None:
        self._tok = None
        self._cache: dict[int, str] = {}
        if path is None:
            return
        from tokenizers import Tokenizer

        from worker.config import ConfigError

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # the library raises its own Exception type
            raise ConfigError(f"gateway.tokenizer: cannot load {file!r} ({e})") from None

    @property
    def tokenizer(self):
        """The loaded `tokenizers.Tokenizer` (None without `gateway.tokenizer`)."""
        return self._tok

    def text(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.decode([token_id], skip_special_tokens=False) if self._tok else f"token_id:{token_id}"
            self._cache[token_id] = s
        return s

    def bytes_of(self, token_id: int) -> list[int] | None:
        return list(self.text(token_id).encode()) if self._tok else None


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def merged_usage(usages: list[Usage | None]) -> dict[str, Any] | None:
    """One request's usage over its `n` choices (OpenAI's: the prompt counted once, the
    completion tokens of every choice summed); None if a choice has none."""
    if not usages or any(u is None for u in usages):
        return None
    first = usages[0]
    return usage_body(Usage(prompt_tokens=first.prompt_tokens, completion_tokens=sum(u.completion_tokens for u in usages),
                            cached_prompt_tokens=first.cached_prompt_tokens))


def with_reasoning(usage: dict[str, Any] | None, renderers: list[Renderer]) -> dict[str, Any] | None:
    """`usage` with `completion_tokens_details.reasoning_tokens` summed over the choices
    read for reasoning (unchanged when none is)."""
    counts = [n for r in renderers if (n := r.reasoning_tokens()) is not None]
    if usage is not None and counts:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(counts)}
    return usage


def usage_body(u: Usage | None) -> dict[str, Any] | None:
    if u is None:
        return None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}


class Renderer:
    """The response objects of one request.

    Args:
        kind: chat or completion.
        response_id: `chatcmpl-…` / `cmpl-…`.
        model: the model name clients asked for.
        created: Unix seconds.
        tokens: logprob token text.
        include_usage: streamed chunks carry `"usage": null` and a last chunk with usage.
        index: the choice these objects render (`n` > 1: one renderer per choice).
        tool_mode: the output is a constrained tool call: rendered as `tool_calls`
            (`worker/gateway/tools.py`), finish reason `tool_calls`.
        parser: reads reasoning and "auto" tool calls from the text (`agents.OutputParser`);
            chat only.
    """

    def __init__(self, kind: Kind, response_id: str, model: str, created: int, tokens: TokenText,
                 include_usage: bool = False, tool_mode: ToolMode | None = None, index: int = 0,
                 parser: OutputParser | None = None) -> None:
        self.kind = kind
        self.index = index
        self.tokens = tokens
        self.include_usage = include_usage
        self.parser = parser if kind == Kind.CHAT and parser is not None and parser.active else None
        forced = kind == Kind.CHAT and tool_mode is not None and not tool_mode.auto
        self.tool_mode = tool_mode if forced and (self.parser is None or self.parser.forced is None) else None
        self._tool_stream = ToolStream(self.tool_mode) if self.tool_mode is not None else None
        self._head = {"id": response_id, "object": "chat.completion.chunk" if kind == Kind.CHAT else "text_completion",
                      "created": created, "model": model}
        self._text_offset = 0  # completions logprobs: characters before the next token

    # ---- whole responses -----------------------------------------------------------------
    def completion(self, fin: Finished, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        """The non-streamed body (`chat.completion` or `text_completion`)."""
        lp = self.logprobs(logprobs) if logprobs is not None else None
        if self.kind == Kind.CHAT:
            message: dict[str, Any] = {"role": "assistant", "content": fin.text, "refusal": None}
            reason = fin.finish_reason.value
            if self.parser is not None:
                message.update(self.parser.message(fin.text))
                if message.get("tool_calls") and reason == "stop":
                    reason = "tool_calls"
            elif self.tool_mode is not None:
                calls = tool_calls(self.tool_mode, fin.text)
                if calls is not None:  # else (cut by length) the text stays the content
                    message.update(content=None, tool_calls=calls)
                    reason = finish_reason(self.tool_mode, reason)
            choice = {"index": self.index, "message": message, "logprobs": lp, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": self.index, "text": fin.text, "logprobs": lp,
                      "finish_reason": fin.finish_reason.value}
            obj = "text_completion"
        return {**self._head, "object": obj, "choices": [choice], "usage": self._usage(fin.usage)}

    def observe(self, text: str, num_tokens: int) -> None:
        """A delta of a non-streamed answer: counts its reasoning tokens."""
        if self.parser is not None:
            self.parser.feed(text, num_tokens)

    def _usage(self, u: Usage | None) -> dict[str, Any] | None:
        """`usage_body`, with `completion_tokens_details.reasoning_tokens` when the
        answer is read for reasoning."""
        return with_reasoning(usage_body(u), [self])

    def reasoning_tokens(self) -> int | None:
        """Tokens of the answer's reasoning (None: not read for reasoning;
        `OutputParser.reasoning_count`)."""
        if self.parser is None or self.parser.formats.reasoning is None:
            return None
        return self.parser.reasoning_count(self.tokens.tokenizer)

    def logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        t = self.tokens
        if self.kind == Kind.CHAT:
            return {"content": [{"token": t.text(e.token_id), "logprob": e.logprob, "bytes": t.bytes_of(e.token_id),
                                 "top_logprobs": [{"token": t.text(i), "logprob": lp, "bytes": t.bytes_of(i)}
                                                  for i, lp in zip(e.top_token_ids, e.top_logprobs)]}
                                for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self._text_offset)
            self._text_offset += len(t.text(e.token_id))
        return {"tokens": [t.text(e.token_id) for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.text(i): lp for i, lp in zip(e.top_token_ids, e.top_logprobs)} for e in entries],
                "text_offset": offsets}

    # ---- streamed chunks -------------------------------------------------------------------
    def _chunk(self, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
        body = {**self._head, "choices": [choice] if choice is not None else []}
        if self.include_usage:
            body["usage"] = usage
        return sse(body)

    def first_chunk(self) -> bytes | None:
        """Chat opens with the assistant role (as OpenAI); completions have no opener."""
        if self.kind != Kind.CHAT:
            return None
        return self._chunk({"index": self.index,
                            "delta": {"role": "assistant", "content": None if self.tool_mode else ""},
                            "logprobs": None, "finish_reason": None})

    def token_chunk(self, text: str, logprobs: list[TokenLogprob] | None, num_tokens: int = 0) -> bytes:
        """The chunks of newly generated text (b"" when a parser holds all of it back)."""
        lp = self.logprobs(logprobs) if logprobs is not None else None
        if self.parser is not None:
            deltas = self.parser.feed(text, num_tokens) or ([{}] if lp is not None else [])
            return b"".join(self._chunk({"index": self.index, "delta": d, "logprobs": lp if i == 0 else None,
                                         "finish_reason": None}) for i, d in enumerate(deltas))
        if self._tool_stream is not None:
            return b"".join(self._chunk({"index": self.index, "delta": d, "logprobs": lp, "finish_reason": None})
                            for d in self._tool_stream.text(text))
        if self.kind == Kind.CHAT:
            return self._chunk({"index": self.index, "delta": {"content": text}, "logprobs": lp,
                                "finish_reason": None})
        return self._chunk({"index": self.index, "text": text, "logprobs": lp, "finish_reason": None})

    def final_chunks(self, fin: Finished, with_usage: bool = True) -> bytes:
        """The chunk with the finish reason, then (with `include_usage` and `with_usage`)
        the usage chunk (`n` > 1: one usage chunk for all choices, `usage_chunk`)."""
        if self.parser is not None:
            out = b"".join(self._chunk({"index": self.index, "delta": d, "logprobs": None, "finish_reason": None})
                           for d in self.parser.finish())
            reason = fin.finish_reason.value
            out += self._chunk({"index": self.index, "delta": {}, "logprobs": None,
                                "finish_reason": "tool_calls" if self.parser.num_calls and reason == "stop" else reason})
        elif self._tool_stream is not None:
            out = b"".join(self._chunk({"index": self.index, "delta": d, "logprobs": None, "finish_reason": None})
                           for d in self._tool_stream.finish())
            out += self._chunk({"index": self.index, "delta": {}, "logprobs": None,
                                "finish_reason": finish_reason(self.tool_mode, fin.finish_reason.value)})
        elif self.kind == Kind.CHAT:
            out = self._chunk({"index": self.index, "delta": {}, "logprobs": None,
                               "finish_reason": fin.finish_reason.value})
        else:
            out = self._chunk({"index": self.index, "text": "", "logprobs": None,
                               "finish_reason": fin.finish_reason.value})
        if self.include_usage and with_usage:
            out += self._chunk(None, self._usage(fin.usage))
        return out

    def usage_chunk(self, usage: dict[str, Any] | None) -> bytes:
        """The last chunk of a stream with `include_usage`: no choices, the usage."""
        return self._chunk(None, usage)


def error_event(err: ApiError) -> bytes:
    """An error after the stream began (the status line is already sent): the SDKs raise
    `APIError` with this body when they read it."""
    return sse(err.body())
