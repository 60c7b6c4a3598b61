"""Tool calls read from free text (schemas/tool_parsers.py) and reasoning split from the
answer (schemas/reasoning.py), per family, on the edges streaming meets: a call split at
every character, two calls, text before and after, a tag inside a JSON string, a
malformed or cut call, unicode in arguments. Every case is parsed whole and streamed one
character at a time, and the two must agree."""

from __future__ import annotations

import json

import pytest

from schemas import reasoning
from schemas.tool_parsers import ToolCallStream, parse


def streamed(family: str, text: str, step: int = 1):
    """Feed `text` in pieces of `step` characters: (parsed, streamed arguments per call,
    events)."""
    stream = ToolCallStream(family)
    events = []
    for i in range(0, len(text), step):
        events += stream.feed(text[i:i + step])
    events += stream.finish()
    args: dict[int, str] = {}
    for e in events:
        if e[0] == "args":
            args[e[1]] = args.get(e[1], "") + e[2]
    return stream.parsed(events), args, events


def calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


CASES = [
    # (family, text, content, calls)
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]),
    ("hermes", "no call here, only <tool text and a < sign", "no call here, only <tool text and a < sign", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "</tool_call> <tool_call>"}}</tool_call> after',
     "after", [("f", {"a": "</tool_call> <tool_call>"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call> after',  # malformed: text
     '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call> after', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"city": "Zürich ✓ 東京", "n": -1.5e3}}',  # EOS, no end tag
     None, [("f", {"city": "Zürich ✓ 東京", "n": -1500.0})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>', None, [("f", {"a": [1, 2]})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ', '<tool_call>{"name": "f", "arguments": {"a": ', []),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
    ("hermes", '<tool_call>[1, 2]</tool_call>', "<tool_call>[1, 2]</tool_call>", []),
    # an opening tag and nothing after it, twice (found by the property test below: the last one was lost)
    ("hermes", "<tool_call><tool_call><tool_call>", "<tool_call><tool_call><tool_call>", []),
    ("mistral", "ok [TOOL_CALLS]", "ok [TOOL_CALLS]", []),
    # found by a 60 000-case random run: blanks before a call that breaks after its name kept their place;
    # a v11 name that is not a function name is text whole and streamed alike
    ("hermes", 'x \n<tool_call>{"name": "g", "arguments": ;}', 'x \n<tool_call>{"name": "g", "arguments": ;}', []),
    ("mistral", '[TOOL_CALLS]a"b[ARGS]{"x": 1}', '[TOOL_CALLS]a"b[ARGS]{"x": 1}', []),
    # a raw control character in the name (JSON forbids it): text, never an exception (found by tools.bench.agents)
    ("hermes", '<tool_call>{"name": "get\nx", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "get\nx", "arguments": {}}</tool_call>', []),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", {"x": 1}), ("g", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": "a;b"}}', None, [("f", {"x": "a;b"})]),
    ("llama3_json", 'Hello {"name": "f", "parameters": {}}', 'Hello {"name": "f", "parameters": {}}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '  {"name": "f", "parameters": {"x": 1', '  {"name": "f", "parameters": {"x": 1', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"y": [1, 2]}}]',
     "Sure.", [("f", {"x": 1}), ("g", {"y": [1, 2]})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{"y": "}"}', None, [("f", {"x": 1}), ("g", {"y": "}"})]),
    ("mistral", "a [TOOL_CALLS] is not followed by a call", "a [TOOL_CALLS] is not followed by a call", []),
]


@pytest.mark.parametrize("family, text, content, expected", CASES)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_whole_and_streamed_parses_agree(family, text, content, expected, step):
    whole = parse(family, text)
    assert whole.content == content and calls(whole) == expected
    got, args, events = streamed(family, text, step)
    assert got.content == content and calls(got) == expected
    for i, call in enumerate(got.calls):  # the streamed pieces add up to each call's arguments
        assert args[i] == call.arguments
    opened = []
    for e in events:  # the calls opened, less those that broke after their name streamed
        if e[0] == "call":
            opened.append((e[1], e[2], e[3]))
        elif e[0] == "broken":
            assert opened.pop()[0] == e[1]
    assert opened == [(i, c.id, c.name) for i, c in enumerate(got.calls)]


def test_a_call_opens_as_soon_as_its_name_is_complete():
    stream = ToolCallStream("hermes")
    assert stream.feed("I will call it. <tool") == [("content", "I will call it. ")]
    assert stream.feed('_call>{"name": "get_wea') == []
    opened = stream.feed('ther", "arguments": {"ci')
    assert opened[0][0] == "call" and opened[0][3] == "get_weather" and opened[1] == ("args", 0, '{"ci')
    assert stream.feed('ty": "Paris"}}</tool_call>') == [("args", 0, 'ty": "Paris"}')]
    assert stream.finish() == []


def test_a_call_broken_after_its_name_streamed_keeps_what_was_sent_and_is_text_when_whole():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1} oops</tool_call>'
    got, _, events = streamed("hermes", text)
    assert [e[0] for e in events][:2] == ["call", "args"] and "broken" in [e[0] for e in events]
    assert got.calls == [] and got.content == text
    assert parse("hermes", text).content == text


def test_an_unknown_family_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        ToolCallStream("xml")


# ---- reasoning --------------------------------------------------------------------------------
R_CASES = [
    ("deepseek_r1", "The user wants x.\nSo y.</think>\n\nThe answer is y.", "The user wants x.\nSo y.", "The answer is y."),
    ("deepseek_r1", "<think>\nthinking</think>answer", "\nthinking", "answer"),
    ("deepseek_r1", "still thinking when the tokens ran out", "still thinking when the tokens ran out", ""),
    ("qwen3", "<think>\nplan</think>\n\nanswer <think> kept", "\nplan", "answer <think> kept"),
    ("qwen3", "plain answer </think> with a stray tag", None, "plain answer </think> with a stray tag"),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "<thi", None, "<thi"),
]


@pytest.mark.parametrize("family, text, thought, answer", R_CASES)
@pytest.mark.parametrize("step", [1, 2, 1000])
def test_reasoning_whole_and_streamed_agree(family, text, thought, answer, step):
    assert reasoning.split(family, text) == (thought, answer)
    stream = reasoning.ReasoningStream(family)
    events = []
    for i in range(0, len(text), step):
        events += stream.feed(text[i:i + step])
    events += stream.finish()
    got_thought = "".join(t for k, t in events if k == "reasoning")
    assert (got_thought if stream.reasoned else None, "".join(t for k, t in events if k == "content")) == (
        thought, answer)
    assert all("</think>" not in t for k, t in events if k == "reasoning")


# ---- any text: never an exception, and the stream agrees with the whole parse -------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FRAGMENTS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<think>", "</think>",
             '{"name": "f", "arguments": ', '{"name": "g", "parameters": ', '{"x": 1}', "}", "{", "[", "]", ",",
             ";", '"', "\\", "\n", " ", "é✓", "\x00", '"a\nb"', "text", "null", "-1e", "<tool", "_call>",
             "[TOOL_CALLS]f[ARGS]", "g[ARGS]", "[TOOL_C"]


@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=24), st.integers(1, 7),
       st.sampled_from(["hermes", "llama3_json", "mistral"]))
@settings(max_examples=400, deadline=None)
def test_any_text_parses_without_error_and_streams_as_it_parses_whole(pieces, step, family):
    text = "".join(pieces)
    whole = parse(family, text)
    got, args, _ = streamed(family, text, step)
    assert (got.content, calls(got)) == (whole.content, calls(whole))
    for i, call in enumerate(got.calls):  # (an empty arguments value streams as "{}" at its close)
        assert args.get(i, "") == call.arguments  # the streamed pieces add up to the arguments
        json.loads(call.arguments)  # every call's arguments are JSON


@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=24), st.integers(1, 7),
       st.sampled_from(["deepseek_r1", "qwen3"]))
@settings(max_examples=300, deadline=None)
def test_any_text_splits_reasoning_without_error_and_streams_as_it_splits_whole(pieces, step, family):
    text = "".join(pieces)
    thought, answer = reasoning.split(family, text)
    stream = reasoning.ReasoningStream(family)
    events = []
    for i in range(0, len(text), step):
        events += stream.feed(text[i:i + step])
    events += stream.finish()
    assert "".join(t for k, t in events if k == "content") == answer
    assert ("".join(t for k, t in events if k == "reasoning") if stream.reasoned else None) == thought
