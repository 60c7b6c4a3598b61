"""The gateway's structured-output fields without services: `response_format`,
`structured_outputs`, `tools` / `tool_choice` → `params.structured`, the 400s, and the
constrained output rendered back as `tool_calls` (whole and streamed)."""

from __future__ import annotations

import json

import pytest

from schemas.params import ChoiceOutput, JsonObjectOutput, JsonSchemaOutput, RegexOutput
from schemas.wire import Finished, FinishReason, Usage
from worker.gateway.errors import ApiError
from worker.gateway.protocol import Kind, parse_body
from worker.gateway.render import Renderer, TokenText

MSG = [{"role": "user", "content": "hi"}]
FN = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
G = {"type": "function", "function": {"name": "g"}}


def chat(**kw):
    return parse_body(Kind.CHAT, {"model": "m", "messages": MSG, **kw})


def rejected(**kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        chat(**kw)
    return e.value


def test_response_formats_and_the_vllm_extension_become_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    r = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert r.params.structured == JsonSchemaOutput(schema=schema) and r.tool_mode is None
    assert chat(response_format={"type": "json_object"}).params.structured == JsonObjectOutput()
    assert chat(response_format={"type": "text"}).params.structured is None
    assert chat(structured_outputs={"choice": ["a", "b"]}).params.structured == ChoiceOutput(choices=["a", "b"])
    assert chat(structured_outputs={"regex": "[0-9]+"}).params.structured == RegexOutput(pattern="[0-9]+")
    c = parse_body(Kind.COMPLETION, {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})
    assert c.params.structured == JsonObjectOutput()


def test_forced_tool_calls_constrain_to_the_functions_parameters():
    named = chat(tools=[FN, G], tool_choice={"type": "function", "function": {"name": "f"}})
    assert named.params.structured == JsonSchemaOutput(schema=FN["function"]["parameters"])
    assert named.tool_mode.name == "f" and named.tools == [FN, G]
    required = chat(tools=[FN, G], tool_choice="required", parallel_tool_calls=False)
    schema = required.params.structured.schema
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert names == ["f", "g"] and required.tool_mode.name is None
    none = chat(tools=[FN], tool_choice="none")
    assert none.params.structured is None and none.tool_mode is None and none.tools == [FN]


@pytest.mark.parametrize("kw, param, code", [
    ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "h"}}}, "tool_choice.function.name",
     None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools[0].type", "unsupported_parameter"),
    ({"tools": [FN, FN], "tool_choice": "required"}, "tools[1].function.name", None),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format", "invalid_structured_output"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid_structured_output"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml", "unsupported_parameter"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", None),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", None),
    ({"response_format": {"type": "json_object"}, "tools": [FN], "tool_choice": "required"}, "response_format",
     None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools", "invalid_structured_output"),
])
def test_bad_structured_fields_are_400_naming_the_field(kw, param, code):
    err = rejected(**kw)
    assert err.status == 400 and err.param == param, (err.param, err.message)
    if code:
        assert err.code == code


def test_tool_calling_history_becomes_template_messages():
    r = parse_body(Kind.CHAT, {"model": "m", "messages": [
        *MSG, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]})
    assistant, tool = r.messages[1].template_dict(), r.messages[2].template_dict()
    assert assistant["content"] is None and assistant["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert tool == {"role": "tool", "content": "2", "tool_call_id": "c1"}


def fin(text: str, reason=FinishReason.STOP) -> Finished:
    return Finished(job_id="j", attempt=1, seq=1, finish_reason=reason, text=text,
                    usage=Usage(prompt_tokens=1, completion_tokens=3))


def test_constrained_outputs_render_as_tool_calls():
    named = chat(tools=[FN], tool_choice={"type": "function", "function": {"name": "f"}})
    r = Renderer(Kind.CHAT, "chatcmpl-1", "m", 0, TokenText(None), tool_mode=named.tool_mode)
    choice = r.completion(fin('{"x":3}'), None)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"x":3}'} and call["id"].startswith("call_")
    required = chat(tools=[FN, G], tool_choice="required")
    r = Renderer(Kind.CHAT, "chatcmpl-2", "m", 0, TokenText(None), tool_mode=required.tool_mode)
    body = r.completion(fin('[{"name":"g","parameters":{}},{"name":"f","parameters":{"x":1}}]'), None)
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("g", {}),
                                                                                                 ("f", {"x": 1})]
    cut = r.completion(fin('[{"name":"f","param', FinishReason.LENGTH), None)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == '[{"name":"f","param'


def _deltas(chunks: bytes) -> list[dict]:
    out = []
    for line in chunks.decode().split("\n\n"):
        if line.startswith("data: {"):
            out.append(json.loads(line[6:])["choices"][0])
    return out


def test_streamed_tool_calls_open_with_id_and_name_then_stream_arguments():
    named = chat(tools=[FN], tool_choice={"type": "function", "function": {"name": "f"}})
    r = Renderer(Kind.CHAT, "chatcmpl-3", "m", 0, TokenText(None), tool_mode=named.tool_mode)
    raw = r.first_chunk() + r.token_chunk('{"x"', None) + r.token_chunk(":3}", None) + r.final_chunks(fin('{"x":3}'))
    ch = _deltas(raw)
    assert ch[0]["delta"] == {"role": "assistant", "content": None}
    first = ch[1]["delta"]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"] == {"name": "f", "arguments": '{"x"'}
    assert ch[2]["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": ":3}"}}
    assert ch[-1]["finish_reason"] == "tool_calls" and ch[-1]["delta"] == {}
    required = chat(tools=[FN, G], tool_choice="required")
    r = Renderer(Kind.CHAT, "chatcmpl-4", "m", 0, TokenText(None), tool_mode=required.tool_mode)
    text = '[{"name":"f","parameters":{"x":1}},{"name":"g","parameters":{}}]'
    raw = b"".join(r.token_chunk(text[i:i + 5], None) for i in range(0, len(text), 5)) + r.final_chunks(fin(text))
    ch = _deltas(raw)
    calls = [c for d in ch for c in d["delta"].get("tool_calls", [])]
    opened = [c for c in calls if "id" in c]  # each call opens once its name is complete, before its arguments
    assert [(c["index"], c["function"]["name"]) for c in opened] == [(0, "f"), (1, "g")]
    assert calls.index(opened[1]) > 1  # the first call's arguments streamed before the second opened
    args = {i: "".join(c["function"]["arguments"] for c in calls if c["index"] == i) for i in (0, 1)}
    assert args == {0: '{"x":1}', 1: "{}"} and ch[-1]["finish_reason"] == "tool_calls"
    r = Renderer(Kind.CHAT, "chatcmpl-5", "m", 0, TokenText(None), tool_mode=required.tool_mode)
    cut = '[{"name":"f","parameters":{"x":1}},{"name":"g","param'  # max_tokens cut the second call
    ch = _deltas(r.token_chunk(cut, None) + r.final_chunks(fin(cut, FinishReason.LENGTH)))
    calls = [c for d in ch for c in d["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls if "id" in c] == ["f", "g"] and ch[-1]["finish_reason"] == "length"
    assert "".join(c["function"]["arguments"] for c in calls if c["index"] == 0) == '{"x":1}'


def test_batch_lines_take_the_same_fields():
    from worker.gateway.batch.lines import line_job, output_line, parse_input

    body = {"model": "m", "messages": MSG, "tools": [FN], "tool_choice": {"type": "function", "function": {"name": "f"}}}
    data = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode()
    bad = {**body, "response_format": {"type": "json_object"}, "tool_choice": "required"}
    data += b"\n" + json.dumps({"custom_id": "b", "url": "/v1/chat/completions", "body": bad}).encode()
    lines, errors = parse_input(data, batch_id="batch_1", endpoint="/v1/chat/completions", kind=Kind.CHAT,
                                model_name="m")
    assert [e.param for e in errors] == ["body.response_format"]
    (line,) = lines
    job = line_job(line, "acme", 0.0, "batch_1")
    assert job.tools == [FN] and job.params.structured == JsonSchemaOutput(schema=FN["function"]["parameters"])
    out = output_line(line, fin('{"x":1}'), "m", 0)["response"]["body"]["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["tool_calls"][0]["function"]["name"] == "f"
