"""A scanner of JSON call objects (`{"name": …, "arguments": {…}}`) in a text that may
still grow: what is known of a call so far (its name once complete, its arguments' text
so far), so a streamed call can open and send arguments before the object closes; and how much
of a growing text may be the start of a tag. Used by `schemas/tool_parsers.py` and
`schemas/reasoning.py`; no JSON library can say this of a prefix.
"""

from __future__ import annotations

import dataclasses
import json
import re

WS = " \t\r\n"
_PRIMITIVE = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")


@dataclasses.dataclass(slots=True)
class CallScan:
    """What is known of a call object `{...}` in a text that may still grow: the name
    once its string is complete, the arguments' text so far (`args_prefix`, certainly
    part of the value) and whole (`args`), `end` (index after `}`) once closed, `error`
    when the text cannot be a call object."""

    name: str | None = None
    args_prefix: str = ""
    args: str | None = None
    end: int | None = None
    error: bool = False


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


def string_end(s: str, i: int) -> int | None:
    """Index after the JSON string starting at `s[i] == '"'`, None if not closed yet."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(s: str, i: int) -> int | None:
    """Index after the JSON value starting at `i`, None if it is not complete in `s`;
    -1 if `s[i]` cannot start a value."""
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                k = string_end(s, j)
                if k is None:
                    return None
                j = k
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _PRIMITIVE.match(s, i)
    if m is None:
        return -1
    return m.end() if m.end() < len(s) else None  # a number may still grow


def scan_call(s: str, i: int) -> CallScan:
    """Scan the call object starting at `s[i]` (whitespace first is skipped)."""
    out = CallScan()
    i = skip_ws(s, i)
    if i >= len(s):
        return out
    if s[i] != "{":
        out.error = True
        return out
    i += 1
    while True:
        i = skip_ws(s, i)
        if i >= len(s):
            return out
        if s[i] == "}":
            out.end = i + 1
            return out
        if s[i] != '"':
            out.error = True
            return out
        k = string_end(s, i)
        if k is None:
            return out
        try:
            key = json.loads(s[i:k])
        except ValueError:
            out.error = True
            return out
        i = skip_ws(s, k)
        if i >= len(s):
            return out
        if s[i] != ":":
            out.error = True
            return out
        v = skip_ws(s, i + 1)
        if v >= len(s):
            return out
        end = value_end(s, v)
        if end == -1:
            out.error = True
            return out
        if key == "name":
            if s[v] != '"':
                out.error = True
                return out
            if end is None:
                return out
            try:
                out.name = json.loads(s[v:end])
            except ValueError:  # e.g. a raw control character in the string
                out.error = True
                return out
        elif key in ("arguments", "parameters"):
            if end is None:
                if s[v] in "{[":
                    out.args_prefix = s[v:]
                return out
            out.args = s[v:end]
            out.args_prefix = out.args if s[v] in "{[" else ""  # a quoted value goes out whole, unwrapped
        elif end is None:
            return out
        i = skip_ws(s, end)
        if i >= len(s):
            return out
        if s[i] == ",":
            i += 1
        elif s[i] != "}":
            out.error = True
            return out


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (what a stream
    must hold back until it knows whether the tag follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
