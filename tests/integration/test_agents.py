"""Agents through the gateway, with a model that reasons and calls tools on its own
(tools/make_agent_model.py: Hermes `<tool_call>` format, `<think>` opened by its
template): the official `openai` client sends `tools` with no `tool_choice` (OpenAI's
default, "auto"), streamed and not, and feeds the tool's result back; the gateway
detects both formats from the chat template and returns `tool_calls`,
`reasoning_content` and `finish_reason: "tool_calls"` from real generations."""

from __future__ import annotations

import asyncio
import json

from schemas.params import SamplingParams
from tests.integration.conftest import worker_config
from tests.integration.gateway_helpers import MODEL, client, gateway_config, running_gateway
from tests.integration.helpers import running_worker
from tools.make_agent_model import TIME_TOOL, WEATHER_TOOL
from worker.client import InflightClient
from worker.engine import Engine

ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris?"}]


async def streamed(stream) -> dict:
    """A streamed chat answer put back together: content, reasoning, calls by index."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "usage": None}
    async for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            out["content"] += d.content or ""
            out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for c in d.tool_calls or []:
                call = out["calls"].setdefault(c.index, {"id": None, "name": None, "arguments": ""})
                if c.id:
                    assert call["id"] is None  # id and name come once, in the call's first delta
                    call["id"], call["name"] = c.id, c.function.name
                call["arguments"] += c.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_auto_tool_calls_and_reasoning_through_the_openai_client(services, prefix, agent_path, tmp_path):
    cfg = worker_config(services, prefix)
    engine = Engine.from_pretrained(str(agent_path), cfg.engine)

    async def main():
        out = {}
        async with running_worker(cfg, engine), \
                running_gateway(gateway_config(services, prefix, tmp_path / "files", tokenizer=agent_path)) as gw:
            c = client(gw)
            out["formats"] = gw.ctx.formats
            base = dict(model=MODEL, temperature=0, max_tokens=80)
            tools = [WEATHER_TOOL, TIME_TOOL]
            out["call"] = await c.chat.completions.create(messages=ASK, tools=tools, **base)
            out["stream"] = await streamed(await c.chat.completions.create(
                messages=ASK, tools=tools, stream=True, stream_options={"include_usage": True}, **base))
            call = out["call"].choices[0].message.tool_calls[0]
            result = {"city": "Paris", "sky": "sunny", "temperature_c": 21}
            follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                            {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
            out["answer"] = await c.chat.completions.create(messages=follow, tools=tools, **base)
            out["answer_stream"] = await streamed(await c.chat.completions.create(
                messages=follow, tools=tools, stream=True, **base))
            out["time"] = await c.chat.completions.create(
                messages=[{"role": "user", "content": "What time is it in Asia/Tokyo?"}], tools=tools, **base)
            out["hello"] = await c.chat.completions.create(messages=[{"role": "user", "content": "Hello!"}],
                                                           tools=tools, **base)
            out["no_tools"] = await c.chat.completions.create(messages=ASK, reasoning_effort="low", **base)  # no knob: ignored
            city = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
                "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
            out["format"] = await c.chat.completions.create(messages=ASK, response_format=city, **base)
            out["format_tools"] = [await c.chat.completions.create(messages=m, tools=tools, response_format=city, **base)
                                   for m in (ASK, [{"role": "user", "content": "Hello!"}])]
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as direct:
                params = SamplingParams(max_tokens=80, temperature=0)
                read = await direct.submit(messages=ASK, tools=tools, params=params, parse_output=True)
                raw = await direct.submit(messages=ASK, tools=tools, params=params)
                out["wire"] = (await direct.result(read, 60), await direct.result(raw, 60))
        return out

    out = asyncio.run(main())
    assert (out["formats"].tool, out["formats"].reasoning, out["formats"].constrained) == ("hermes", "deepseek_r1", True)
    choice = out["call"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    reasoning = choice.message.model_extra["reasoning_content"]
    assert "weather in Paris" in reasoning and "</think>" not in reasoning
    details = out["call"].usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < out["call"].usage.completion_tokens
    s = out["stream"]
    assert s["finish"] == "tool_calls" and s["content"] == "" and s["reasoning"] == reasoning
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == [("get_weather", {"city": "Paris"})]
    assert s["calls"][0]["id"].startswith("call_")
    assert s["usage"].completion_tokens == out["call"].usage.completion_tokens
    assert s["usage"].completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    answer = out["answer"].choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content.startswith("It is sunny in Paris")
    assert out["answer_stream"]["content"] == answer.message.content and not out["answer_stream"]["calls"]
    (t,) = out["time"].choices[0].message.tool_calls  # (the tiny model may pick another zone: its arguments' shape)
    assert t.function.name == "get_time" and list(json.loads(t.function.arguments)) == ["timezone"]
    hello = out["hello"].choices[0]
    assert hello.finish_reason == "stop" and not hello.message.tool_calls and hello.message.content.startswith("Hello")
    # no tools: reasoning is still split off; the answer is whatever the model writes after it
    assert out["no_tools"].choices[0].message.model_extra["reasoning_content"]
    # a JSON answer still comes after the reasoning (the constraint starts where the reasoning ends)
    fmt = out["format"].choices[0].message
    assert fmt.model_extra["reasoning_content"] and list(json.loads(fmt.content)) == ["city"]
    # tools and a response format: either calls, or the format's JSON
    called, answered = (r.choices[0] for r in out["format_tools"])
    assert called.finish_reason == "tool_calls" and called.message.tool_calls[0].function.name == "get_weather"
    # small talk: prose is neither, so the model must pick one of the two (never text to the limit)
    if answered.message.tool_calls:
        assert answered.finish_reason == "tool_calls" and json.loads(answered.message.tool_calls[0].function.arguments)
    else:
        assert answered.finish_reason == "stop" and list(json.loads(answered.message.content)) == ["city"]
    # on the Kafka wire: a job with parse_output gets the same reading on its finished event
    read, raw = out["wire"]
    assert read.text == raw.text and read.reasoning == reasoning and read.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in read.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert (raw.content, raw.reasoning, raw.tool_calls) == (None, None, None)


def test_an_openai_agents_sdk_agent_and_a_langchain_model_with_tools_run_unchanged(services, prefix, agent_path,
                                                                                    tmp_path):
    """The OpenAI Agents SDK runs an agent with one function tool to completion (the model
    calls the tool, the SDK runs it and feeds the result back, the model answers), and
    LangChain's `ChatOpenAI.bind_tools` reads the same call as `tool_calls`."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from langchain_openai import ChatOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, "sky": "rainy", "temperature_c": 12})

    cfg = worker_config(services, prefix)
    engine = Engine.from_pretrained(str(agent_path), cfg.engine)

    async def main():
        async with running_worker(cfg, engine), \
                running_gateway(gateway_config(services, prefix, tmp_path / "files", tokenizer=agent_path)) as gw:
            c = client(gw)
            agent = Agent(name="weather", instructions="You are a helpful assistant.", tools=[get_weather],
                          model=OpenAIChatCompletionsModel(model=MODEL, openai_client=c),
                          model_settings=ModelSettings(temperature=0, max_tokens=80))
            run = await Runner.run(agent, "What is the weather in Berlin?", max_turns=4)
            llm = ChatOpenAI(model=MODEL, base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=c.api_key,
                             temperature=0, max_tokens=80, max_retries=0)
            message = await llm.bind_tools([WEATHER_TOOL]).ainvoke("What is the weather in Lima?")
            return run, message

    run, message = asyncio.run(main())
    assert calls == ["Berlin"]  # called once, with the city from the question
    assert run.final_output.startswith("It is rainy in Berlin")
    assert [(t["name"], t["args"]) for t in message.tool_calls] == [("get_weather", {"city": "Lima"})]


FLAT_WEATHER = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat spelling


def test_the_responses_api_through_the_openai_client_and_the_agents_sdks_default_model(services, prefix, agent_path,
                                                                                        tmp_path):
    """`client.responses.create` and `.stream`: the model's reasoning item, its function
    call, the tool's output fed back by `previous_response_id` (the conversation kept in
    Redis), the final text; GET and DELETE of a stored response; and an Agents SDK agent
    on its default model (the Responses API) run to completion."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, "sky": "windy", "temperature_c": 9})

    cfg = worker_config(services, prefix)
    engine = Engine.from_pretrained(str(agent_path), cfg.engine)

    async def main():
        out = {}
        async with running_worker(cfg, engine), \
                running_gateway(gateway_config(services, prefix, tmp_path / "files", tokenizer=agent_path)) as gw:
            c = client(gw)
            base = dict(model=MODEL, temperature=0, max_output_tokens=80, tools=[FLAT_WEATHER],
                        instructions="You are a helpful assistant.")
            first = await c.responses.create(input="What is the weather in Paris?", **base)
            call = next(i for i in first.output if i.type == "function_call")
            result = json.dumps({"city": "Paris", "sky": "cloudy", "temperature_c": 17})
            out["first"], out["second"] = first, await c.responses.create(
                previous_response_id=first.id, **base,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])
            async with c.responses.stream(input="What is the weather in Paris?", **base) as stream:
                out["events"] = [e.type async for e in stream]
                out["streamed"] = await stream.get_final_response()
            out["got"] = await c.responses.retrieve(first.id)
            out["deleted"] = await c.responses.delete(first.id)
            try:
                await c.responses.retrieve(first.id)
            except Exception as e:  # noqa: BLE001 (the SDK's NotFoundError)
                out["after_delete"] = type(e).__name__
            agent = Agent(name="weather", instructions="You are a helpful assistant.", tools=[get_weather],
                          model=OpenAIResponsesModel(model=MODEL, openai_client=c),
                          model_settings=ModelSettings(temperature=0, max_tokens=80))
            out["agent"] = await Runner.run(agent, "What is the weather in Berlin?", max_turns=4)
        return out

    out = asyncio.run(main())
    first = out["first"]
    assert first.status == "completed" and first.id.startswith("resp_")
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    assert "weather in Paris" in first.output[0].content[0].text
    fc = first.output[1]
    assert (fc.name, json.loads(fc.arguments)) == ("get_weather", {"city": "Paris"}) and fc.call_id.startswith("call_")
    assert first.usage.output_tokens_details.reasoning_tokens > 0
    second = out["second"]
    assert second.status == "completed" and second.output_text.startswith("It is cloudy in Paris")
    assert [i.type for i in second.output] == ["reasoning", "message"]
    events = out["events"]
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.reasoning_text.delta", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done"):
        assert kind in events, kind
    streamed = out["streamed"]
    assert [(i.type, getattr(i, "arguments", None)) for i in streamed.output] == [
        (i.type, getattr(i, "arguments", None)) for i in first.output]
    assert out["got"].id == first.id and out["got"].output[1].arguments == fc.arguments
    assert out["deleted"] is None or getattr(out["deleted"], "deleted", True)
    assert out["after_delete"] == "NotFoundError"
    assert calls == ["Berlin"] and out["agent"].final_output.startswith("It is windy in Berlin")
