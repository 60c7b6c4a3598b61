"""The gateway's agent features without services (worker/gateway/agents.py,
responses_protocol.py): families detected from chat templates, "auto" without a known
family (400) and with one (the grammar), answers rendered as chat messages and streamed
deltas, `reasoning_effort` as a template variable, and Responses-API bodies turned into
chat bodies and answers into output items and events."""

from __future__ import annotations

import json

import msgspec
import pytest

from schemas.params import GrammarOutput
from schemas.wire import Finished, FinishReason, Usage
from worker.gateway.agents import OutputFormats, auto_tool_calls, detect, output_parser
from worker.gateway.errors import ApiError
from worker.gateway.protocol import Kind, parse_body
from worker.gateway.render import Renderer, TokenText
from worker.gateway.responses_protocol import ResponseOutput, chat_body

FN = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MSG = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = ('The user asks.\n</think>\n\nLet me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call>')


def chat(**kw):
    return parse_body(Kind.CHAT, {"model": "m", "messages": MSG, **kw})


@pytest.mark.parametrize("template, expected", [
    ("{{ '<tool_call>' }}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", ("hermes", None)),
    ("[TOOL_CALLS] {{ x }}", ("mistral", None)),
    ("<|python_tag|>{{ x }}", ("llama3_json", None)),
    ("<think></think>{% if add_generation_prompt %}{{ '<|Assistant|><think>\\n' }}{% endif %}", (None, "deepseek_r1")),
    ("{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is false %}<think>\n\n</think>"
     "{% endif %}{% endif %}<tool_call>", ("hermes", "qwen3")),
    ("<tool_call> [TOOL_CALLS]", (None, None)),  # two formats: not guessed
    (None, (None, None)),
])
def test_families_are_read_from_the_chat_template(template, expected):
    assert detect(template) == expected


def test_auto_needs_a_family_and_gets_its_grammar():
    req = chat(tools=[FN])
    assert req.tool_mode.auto and req.params.structured is None
    with pytest.raises(ApiError) as e:
        auto_tool_calls(req, OutputFormats())
    assert e.value.status == 400 and e.value.param == "tool_choice" and "gateway.tool_parser" in e.value.message
    auto_tool_calls(req, OutputFormats("hermes", None, constrained=True))
    assert isinstance(req.params.structured, GrammarOutput) and "<tool_call>" in req.params.structured.grammar
    free = chat(tools=[FN], tool_choice="auto")
    auto_tool_calls(free, OutputFormats("hermes", None, constrained=False))
    assert free.params.structured is None
    fmt = chat(tools=[FN], response_format={"type": "json_object"})
    auto_tool_calls(fmt, OutputFormats("hermes", "deepseek_r1"))
    grammar = fmt.params.structured.grammar  # calls, or the format's JSON after the reasoning
    assert "<tool_call>" in grammar and "</think>" in grammar and '"type": "object"' in grammar
    assert fmt.reasoning_first
    other = chat(tools=[FN], response_format={"type": "json_object"})
    auto_tool_calls(other, OutputFormats("mistral", None))
    assert not isinstance(other.params.structured, GrammarOutput)  # mistral: the format alone


def test_a_json_constraint_starts_after_the_reasoning_and_others_leave_no_room_for_it():
    fmt = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}})
    auto_tool_calls(fmt, OutputFormats(None, "deepseek_r1"))
    assert fmt.reasoning_first and fmt.params.structured.grammar.count("</think>") == 1
    assert '"additionalProperties": false' in fmt.params.structured.grammar  # strict, as the engine compiles it
    forced = chat(tools=[FN], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    auto_tool_calls(forced, OutputFormats("hermes", "qwen3"))
    assert forced.reasoning_first and isinstance(forced.params.structured, GrammarOutput)
    parser = output_parser(forced, OutputFormats("hermes", "qwen3"))
    assert parser.forced is forced.tool_mode
    message = parser.message('<think>plan</think>\n{"city": "Paris"}')
    assert message["reasoning_content"] == "plan" and message["tool_calls"][0]["function"]["arguments"] == (
        '{"city": "Paris"}') and message["content"] is None
    regex = chat(structured_outputs={"regex": "[a-z]+"})
    auto_tool_calls(regex, OutputFormats(None, "deepseek_r1"))
    assert not regex.reasoning_first and output_parser(regex, OutputFormats(None, "deepseek_r1")) is None
    plain = chat()
    auto_tool_calls(plain, OutputFormats(None, None))
    assert plain.reasoning_first and plain.params.structured is None
    completion = parse_body(Kind.COMPLETION, {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})
    auto_tool_calls(completion, OutputFormats(None, "deepseek_r1"))  # no chat template: no reasoning to wait for
    assert not isinstance(completion.params.structured, GrammarOutput)


def fin(text: str, reason: FinishReason = FinishReason.STOP) -> Finished:
    return Finished(job_id="j", seq=9, attempt=1, finish_reason=reason, text=text,
                    usage=Usage(prompt_tokens=5, completion_tokens=30))


def test_a_whole_answer_becomes_reasoning_content_and_tool_calls():
    req = chat(tools=[FN])
    formats = OutputFormats("hermes", "deepseek_r1")
    r = Renderer(Kind.CHAT, "chatcmpl-1", "m", 0, TokenText(None), parser=output_parser(req, formats))
    for piece, n in (("The user asks.\n", 4), ("</think>\n\n", 2), (ANSWER.split("</think>\n\n")[1], 24)):
        r.observe(piece, n)
    body = r.completion(fin(ANSWER), None)
    (choice,) = body["choices"]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] == "Let me look."
    assert msg["reasoning_content"] == "The user asks.\n"
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    cut = Renderer(Kind.CHAT, "c", "m", 0, TokenText(None), parser=output_parser(req, formats))
    assert cut.completion(fin(ANSWER[:-20], FinishReason.LENGTH), None)["choices"][0]["finish_reason"] == "length"


def test_a_streamed_answer_gives_reasoning_then_content_then_the_call():
    req = chat(tools=[FN], stream=True)
    r = Renderer(Kind.CHAT, "chatcmpl-1", "m", 0, TokenText(None),
                 parser=output_parser(req, OutputFormats("hermes", "deepseek_r1")))
    chunks = b"".join(r.token_chunk(ANSWER[i:i + 3], None, 1) for i in range(0, len(ANSWER), 3))
    chunks += r.final_chunks(fin(ANSWER))
    deltas = [json.loads(line[6:])["choices"][0] for line in chunks.split(b"\n\n") if line.startswith(b"data: ")]
    reasoning = "".join(d["delta"].get("reasoning_content", "") for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert reasoning == "The user asks.\n" and content == "Let me look."
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_no_reasoning_is_read_from_an_answer_whose_constraint_leaves_no_room_for_it():
    named = chat(tools=[FN], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    named.reasoning_first = False  # (a model without reasoning when the constraint was made)
    assert output_parser(named, OutputFormats("hermes", "deepseek_r1")) is None
    assert output_parser(chat(), OutputFormats("hermes", "deepseek_r1")) is not None  # reasoning only


def test_reasoning_effort_and_chat_template_kwargs_go_to_the_template():
    assert chat(reasoning_effort="low").chat_template_kwargs == {"reasoning_effort": "low"}
    assert chat(chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs == {"enable_thinking": False}
    for bad, param in (({"reasoning_effort": "extreme"}, "reasoning_effort"),
                       ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                       ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs")):
        with pytest.raises(ApiError) as e:
            chat(**bad)
        assert e.value.status == 400 and e.value.param == param
    from schemas.wire import Job

    with pytest.raises(msgspec.ValidationError):  # the wire contract refuses the same for producers
        msgspec.convert({"job_id": "j", "messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}},
                        Job)


def test_a_responses_body_is_the_chat_body_it_stands_for():
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "reasoning": {"effort": "low"},
            "tools": [{"type": "function", "name": "get_weather", "parameters": FN["function"]["parameters"]}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
                      {"type": "reasoning", "id": "rs_1", "summary": []},
                      {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}
    history = [{"role": "user", "content": "earlier"}]
    c = chat_body(body, history)
    assert [m["role"] for m in c["messages"]] == ["system", "user", "user", "assistant", "tool"]
    assert c["messages"][3]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert c["tools"][0]["function"]["name"] == "get_weather" and c["max_tokens"] == 20
    assert c["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert c["response_format"]["json_schema"]["name"] == "x" and c["reasoning_effort"] == "low"
    for bad, param in (({"tools": [{"type": "web_search"}]}, "tools[0].type"), ({"background": True}, "background"),
                       ({"frobnicate": 1}, "frobnicate"), ({"input": [{"type": "input_image"}]}, "input[0].type")):
        with pytest.raises(ApiError) as e:
            chat_body({"model": "m", "input": "x", **bad}, [])
        assert e.value.param == param


def test_output_items_and_their_events():
    out = ResponseOutput()
    events = []
    for d in ({"reasoning_content": "think"}, {"content": "Let me look."},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}):
        events += out.apply(d)
    events += out.close()
    assert [i["type"] for i in out.items] == ["reasoning", "message", "function_call"]
    assert out.items[2]["arguments"] == '{"city": "Paris"}' and out.items[2]["status"] == "completed"
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert out.chat_message() == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
