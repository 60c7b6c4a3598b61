"""Tool calls in a model's free text ("auto" tool choice): each model family writes its
calls in the format its chat template teaches, and these parsers read them back, whole
(`parse`) or as the text streams (`ToolCallStream`). No torch, no tokenizer: the gateway
and the worker both use them.

Families (the formats vLLM's tool parsers of the same names read; this is our own code):

  - `hermes` (Hermes 2/3, Qwen2.5, Qwen3): `<tool_call>{"name": N, "arguments": {...}}</tool_call>`,
    any number, text allowed around them.
  - `llama3_json` (Llama 3.1–3.3 JSON tool calling): the whole output is one or more
    `{"name": N, "parameters": {...}}` objects separated by `;`, optionally after
    `<|python_tag|>`; an output that does not start that way is text.
  - `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects, or
    (tokenizer v11+) `[TOOL_CALLS]N[ARGS]{...}`, repeated; text may precede it.

A call's `arguments` are returned as JSON text (OpenAI's `function.arguments`) exactly
as generated (`"parameters"` is read as `"arguments"`; an arguments value that is a JSON
string holding JSON is unwrapped). A call whose JSON is malformed or cut short is not a
call: it stays in the content, so a client sees the model's text rather than an error.
Streamed, a call's id and name go out once the name is complete and its arguments as
they are generated; a call that then breaks keeps what was sent (the whole parse of the
same text returns it as content) — with constrained "auto" (`tool_call_grammar`) calls
cannot break except by `max_tokens`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from schemas.partial_json import WS as _WS
from schemas.partial_json import CallScan, held_back, scan_call, skip_ws, value_end

FAMILIES = ("hermes", "llama3_json", "mistral")


def call_id() -> str:
    """An OpenAI-style tool call id (`call_` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass(slots=True)
class ParsedCall:
    """One call read from the text: `arguments` is JSON text."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=call_id)


@dataclasses.dataclass(slots=True)
class Parsed:
    """A whole output split into text (`content`, None when only calls remain) and calls."""

    content: str | None
    calls: list[ParsedCall]


def _arguments(raw: str | None) -> str | None:
    """A complete arguments value as JSON text of an object, or None if it is not one."""
    if raw is None:
        return "{}"
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if isinstance(value, str):  # some models quote the arguments
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(inner, dict) else None
    return raw if isinstance(value, dict) else None


def _complete(scan: CallScan) -> ParsedCall | None:
    if scan.error or scan.end is None or scan.name is None:
        return None
    args = _arguments(scan.args)
    return None if args is None else ParsedCall(scan.name, args)


def _closed_outside(s: str, i: int) -> bool:
    """Whether hermes' closing tag occurs after `i` outside every JSON string."""
    j = s.find(_HERMES_END, i)
    while j >= 0:
        k, inside = i, False
        while k < j:
            if s[k] == "\\" and inside:
                k += 2
                continue
            if s[k] == '"':
                inside = not inside
            k += 1
        if not inside and k == j:
            return True
        j = s.find(_HERMES_END, j + 1)
    return False


# ---- whole outputs ----------------------------------------------------------------------------
def parse(family: str, text: str) -> Parsed:
    """Split a whole output into content and calls.

    Raises:
        ValueError: `family` is not one of FAMILIES.
    """
    stream = ToolCallStream(family)
    events = stream.feed(text) + stream.finish()
    return stream.parsed(events)


# ---- streamed outputs -------------------------------------------------------------------------
_TEXT, _CALLS, _AFTER_CALL, _REST = "text", "calls", "after_call", "rest"
_OPENER = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
_HERMES_END = "</tool_call>"
_ARGS_TAG = "[ARGS]"
_V11_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")  # a function name before `[ARGS]`


class ToolCallStream:
    """Incremental parse of one output. `feed(piece)` and then `finish()` return events:
    `("content", text)`, `("call", index, id, name)` (a call opens), `("args", index,
    text)` (more of its arguments), `("broken", index, text)` (the call opened at
    `index` turned out malformed; `text` is its raw text, content for a whole parse). Text that may be the start of a call's opening tag is
    held back until it is known; whitespace between calls is dropped.

    States: text (looking for the opening tag), calls (inside the call region: one call
    for hermes, the rest of the output for the others), after_call (hermes: the closing
    tag), rest (mistral / llama3_json after their calls, or after a region that was not
    a call: everything is text).

    Raises:
        ValueError: `family` is not one of FAMILIES (from the constructor).
    """

    def __init__(self, family: str) -> None:
        if family not in FAMILIES:
            raise ValueError(f"tool call parser {family!r}: one of {list(FAMILIES)}")
        self.family = family
        self.opener = _OPENER[family]
        self.buf = ""
        self.pos = 0  # the text before this is handled
        self.state = _TEXT
        self.calls: list[ParsedCall] = []
        self._raw_start = 0  # where the current call region's text begins (for a fall back to text)
        self._array = False  # mistral: inside `[...]`
        self._open_id: str | None = None  # the call being generated, once its name was sent
        self._sent_args = ""  # what of its arguments was sent
        self._pending_ws = ""

    def feed(self, piece: str) -> list[tuple]:
        self.buf += piece
        return self._advance(final=False)

    def finish(self) -> list[tuple]:
        return self._advance(final=True)

    def parsed(self, events: list[tuple]) -> Parsed:
        """The whole parse from all of one output's events."""
        text = "".join(e[1] if e[0] == "content" else e[2] for e in events if e[0] in ("content", "broken"))
        if self.calls:
            text = text.strip(_WS)
        return Parsed(content=text or None, calls=list(self.calls))

    # ---- the state machine
    def _advance(self, final: bool) -> list[tuple]:
        out: list[tuple] = []
        step = {_TEXT: self._text, _CALLS: self._calls, _AFTER_CALL: self._after_call, _REST: self._rest}
        while True:
            before = (self.pos, self.state)
            step[self.state](out, final)
            if (self.pos, self.state) == before:
                break
        if final:
            if self.state == _CALLS and self.buf[self._raw_start:].strip(_WS):
                self._fall_back(out)  # cut short (or only the opening tag came): not a call
            self._pending_ws = ""  # blanks after the last call
        return out

    def _content(self, out: list[tuple], text: str) -> None:
        """Text for the client; blanks after a call are held until text follows them
        (dropped before another call or at the end), whatever the chunking."""
        if not text:
            return
        if self.calls and not text.strip(_WS):
            self._pending_ws += text
            return
        out.append(("content", self._pending_ws + text))
        self._pending_ws = ""

    def _enter_calls(self, at: int, body: int) -> None:
        self.state, self._raw_start, self.pos = _CALLS, at, body

    def _text(self, out: list[tuple], final: bool) -> None:
        buf = self.buf
        if self.family == "llama3_json":  # calls only at the very start of the output
            i = skip_ws(buf, self.pos)
            if i >= len(buf):
                return
            if buf.startswith(self.opener, i):
                self._enter_calls(self.pos, i + len(self.opener))
            elif buf[i] == "{":
                self._enter_calls(self.pos, i)
            elif self.opener.startswith(buf[i:]) and not final:
                return  # maybe the tag, still arriving
            else:
                self.state = _REST
            return
        k = buf.find(self.opener, self.pos)
        if k >= 0:
            self._content(out, buf[self.pos:k])
            self._enter_calls(k, k + len(self.opener))
            return
        keep = 0 if final else held_back(buf[self.pos:], self.opener)
        self._content(out, buf[self.pos:len(buf) - keep])
        self.pos = len(buf) - keep

    def _rest(self, out: list[tuple], final: bool) -> None:
        self._content(out, self.buf[self.pos:])
        self.pos = len(self.buf)

    def _after_call(self, out: list[tuple], final: bool) -> None:
        buf = self.buf
        j = skip_ws(buf, self.pos)
        if buf.startswith(_HERMES_END, j):
            self.state, self.pos = _TEXT, j + len(_HERMES_END)
        elif j < len(buf) and not _HERMES_END.startswith(buf[j:]):
            self.state = _TEXT  # no closing tag: the call stands, text follows
        elif final:
            self.state = _TEXT

    def _calls(self, out: list[tuple], final: bool) -> None:
        buf = self.buf
        i = skip_ws(buf, self.pos)
        if i >= len(buf):
            return
        if self.family == "mistral":
            i = self._mistral_separators(buf, i)
            if i is None or i >= len(buf):
                return
            if buf[i] == "]" and self._array:
                self.state, self.pos = _REST, i + 1
                return
            if buf[i] != "{":
                self._mistral_v11(out, buf, i, final)
                return
        elif self.family == "llama3_json" and self.calls:
            if buf[i] != ";":
                self.state = _REST  # text after the calls
                return
            i = skip_ws(buf, i + 1)
            if i >= len(buf):
                return
        scan = scan_call(buf, i)
        self._emit(out, scan.name, scan.args_prefix, scan.error)
        if scan.error:
            self._fall_back(out)
            return
        if scan.end is None:
            if self.family == "hermes" and _closed_outside(buf, i):
                self._fall_back(out)  # `</tool_call>` before the object closed
            return
        call = _complete(scan)
        if call is None:
            self._fall_back(out)
            return
        self._close(out, call)
        self.pos = self._raw_start = scan.end
        if self.family == "hermes":
            self.state = _AFTER_CALL

    def _mistral_separators(self, buf: str, i: int) -> int | None:
        """Consume the `[` opening the array, a `,` between its items, or a repeated
        opener (moves `pos` past it); None: cannot tell yet."""
        if not self._array and not self.calls and buf[i] == "[":
            if _ARGS_TAG.startswith(buf[i:i + len(_ARGS_TAG)]) and len(buf) - i < len(_ARGS_TAG):
                return None
            self._array = True
            self.pos = i + 1
        elif self._array and buf[i] == "," and self.calls:
            self.pos = i + 1
        elif not self._array and buf.startswith(self.opener, i):
            self.pos = i + len(self.opener)
        elif not self._array and self.calls and self.opener.startswith(buf[i:]):
            return None  # the next call's opener, still arriving
        else:
            return i
        return skip_ws(buf, self.pos)

    def _mistral_v11(self, out: list[tuple], buf: str, i: int, final: bool) -> None:
        """`N[ARGS]{...}`: the name up to `[ARGS]`, then one JSON object."""
        if self._array:
            self._fall_back(out)
            return
        k = buf.find(_ARGS_TAG, i)
        name = buf[i:k] if k >= 0 else buf[i:len(buf) - held_back(buf[i:], _ARGS_TAG)]  # (less a tag arriving)
        if not _V11_NAME.fullmatch(name) and not (k < 0 and not name):  # the same rule whole or streamed
            self._fall_back(out)
            return
        if k < 0:
            if final:
                self._fall_back(out)
            return
        v = skip_ws(buf, k + len(_ARGS_TAG))
        if v >= len(buf):
            return
        end = value_end(buf, v)
        if end == -1 or buf[v] != "{":
            self._fall_back(out)
            return
        self._emit(out, name, buf[v:] if end is None else buf[v:end], False)
        if end is None:
            return
        args = _arguments(buf[v:end])
        if args is None:
            self._fall_back(out)
            return
        self._close(out, ParsedCall(name, args))
        self.pos = self._raw_start = end

    def _emit(self, out: list[tuple], name: str | None, args_prefix: str, error: bool) -> None:
        """Open the call once its name is known; send what of its arguments is new."""
        if name is None or error:
            return
        index = len(self.calls)
        if self._open_id is None:
            self._open_id, self._pending_ws = call_id(), ""
            out.append(("call", index, self._open_id, name))
        if len(args_prefix) > len(self._sent_args):
            out.append(("args", index, args_prefix[len(self._sent_args):]))
            self._sent_args = args_prefix

    def _close(self, out: list[tuple], call: ParsedCall) -> None:
        """A complete call: the rest of its arguments (all of them when they were a
        quoted string, or absent) goes out, and it is kept."""
        if self._open_id is None:
            self._open_id, self._pending_ws = call_id(), ""
            out.append(("call", len(self.calls), self._open_id, call.name))
        if call.arguments.startswith(self._sent_args):
            rest = call.arguments[len(self._sent_args):]
        else:  # sent nothing that differs: only a quoted value (never streamed) gets here
            rest = call.arguments
        if rest:
            out.append(("args", len(self.calls), rest))
        call.id = self._open_id
        self.calls.append(call)
        self._raw_start = len(self.buf)  # (set to the call's end by the caller)
        self._open_id, self._sent_args = None, ""

    def _fall_back(self, out: list[tuple]) -> None:
        """A call region that is not a call: its text from the opening tag on is content
        (unless the call's name was already streamed: then what was sent stands)."""
        raw = self.buf[self._raw_start:]
        if self._open_id is None:
            self._content(out, raw)
        else:
            out.append(("broken", len(self.calls), self._pending_ws + raw))
            self._pending_ws = ""
        self._open_id, self._sent_args = None, ""
        self.pos = len(self.buf)
        self.state = _TEXT if self.family == "hermes" else _REST
