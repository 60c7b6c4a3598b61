"""Reasoning in a model's output (`<think>…</think>`), split from the answer: returned
as `reasoning_content` by the gateway and carried on the Kafka wire, never mixed into
`content`. Whole (`split`) or streamed (`ReasoningStream`); no torch.

Families (the conventions vLLM's reasoning parsers of the same names read; our code):

  - `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the chat template opens `<think>`
    in the prompt, so the output starts inside the reasoning; it ends at `</think>` (an
    output that never closes it is all reasoning). A `<think>` the model writes itself
    at the start is dropped.
  - `qwen3` (Qwen3, and templates where the model opens the tag): reasoning only when
    the output starts with `<think>`; else it is all answer.

The answer is what follows `</think>` with its leading newlines dropped. Tool-call
parsing and structured outputs read the answer only.
"""

from __future__ import annotations

import re

from schemas.partial_json import held_back

FAMILIES = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def split(family: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a whole output.

    Raises:
        ValueError: `family` is not one of FAMILIES.
    """
    stream = ReasoningStream(family)
    events = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in events if kind == "reasoning")
    answer = "".join(t for kind, t in events if kind == "content")
    return (reasoning if stream.reasoned else None), answer


class ReasoningStream:
    """Incremental split of one output: `feed(piece)` then `finish()` return
    `("reasoning", text)` and `("content", text)` events, in order. A piece of a tag
    is held back until it is known. `reasoned`: the output had a reasoning part.

    Raises:
        ValueError: `family` is not one of FAMILIES (from the constructor).
    """

    def __init__(self, family: str) -> None:
        if family not in FAMILIES:
            raise ValueError(f"reasoning parser {family!r}: one of {list(FAMILIES)}")
        self.family = family
        self.buf = ""
        self.pos = 0
        self.state = "start"  # start -> reasoning -> answer_start -> answer
        self.reasoned = False

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.buf += piece
        return self._advance(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while True:
            before = (self.pos, self.state)
            getattr(self, "_" + self.state)(out, final)
            if (self.pos, self.state) == before:
                return out

    def _start(self, out: list, final: bool) -> None:
        rest = self.buf[self.pos:]
        body = rest.lstrip()
        if body.startswith(OPEN):
            self.pos = len(self.buf) - len(body) + len(OPEN)
            self.state, self.reasoned = "reasoning", True
        elif OPEN.startswith(body) and not final:
            return  # maybe the tag, still arriving (or only blanks so far)
        elif self.family == "deepseek_r1":
            self.state, self.reasoned = "reasoning", True
        else:
            self.state = "answer"

    def _reasoning(self, out: list, final: bool) -> None:
        k = self.buf.find(CLOSE, self.pos)
        if k >= 0:
            if k > self.pos:
                out.append(("reasoning", self.buf[self.pos:k]))
            self.pos, self.state = k + len(CLOSE), "answer_start"
            return
        keep = 0 if final else held_back(self.buf[self.pos:], CLOSE)
        end = len(self.buf) - keep
        if end > self.pos:
            out.append(("reasoning", self.buf[self.pos:end]))
            self.pos = end

    def _answer_start(self, out: list, final: bool) -> None:
        m = re.match(r"\n*", self.buf[self.pos:])
        self.pos += m.end()
        if self.pos < len(self.buf) or final:
            self.state = "answer"

    def _answer(self, out: list, final: bool) -> None:
        if self.pos < len(self.buf):
            out.append(("content", self.buf[self.pos:]))
            self.pos = len(self.buf)
