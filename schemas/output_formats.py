"""Which output conventions a model follows, read from its chat template, and a whole
answer read with them: the one place the gateway (`worker/gateway/agents.py`) and the
worker (a job's `parse_output`, carried on its `finished` event) share. No torch.
"""

from __future__ import annotations

import dataclasses
import re

from schemas import reasoning, tool_parsers


def detect(template: str | None) -> tuple[str | None, str | None]:
    """(tool call family, reasoning family) a chat template teaches, each None when it
    shows none (or more than one tool format): `<tool_call>` hermes, `[TOOL_CALLS]`
    mistral, `<|python_tag|>` llama3_json; `</think>` with a generation prompt that opens
    `<think>` deepseek_r1, else qwen3."""
    if not template:
        return None, None
    tools = [f for f, mark in (("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"),
                               ("llama3_json", "<|python_tag|>")) if mark in template]
    tool = tools[0] if len(tools) == 1 else None
    think = None
    if reasoning.CLOSE in template:
        gen = re.split(r"add_generation_prompt", template)[-1][:200]
        opens = reasoning.OPEN in gen and reasoning.CLOSE not in gen
        think = "deepseek_r1" if opens else "qwen3"
    return tool, think


@dataclasses.dataclass(slots=True)
class ReadAnswer:
    """A whole answer read: `reasoning` (None: none), `content` (None: only calls), `calls`."""

    reasoning: str | None
    content: str | None
    calls: list[tool_parsers.ParsedCall]


def read_answer(text: str, tool_family: str | None, reasoning_family: str | None) -> ReadAnswer:
    """Split `text` into reasoning, content and tool calls (a family None: not read)."""
    thought, answer = reasoning.split(reasoning_family, text) if reasoning_family else (None, text)
    if tool_family is None:
        return ReadAnswer(thought, answer, [])
    parsed = tool_parsers.parse(tool_family, answer)
    if not parsed.calls:
        return ReadAnswer(thought, answer, [])
    return ReadAnswer(thought, parsed.content, parsed.calls)
