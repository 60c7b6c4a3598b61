"""Structured outputs end to end on the real dev stack: a job with a JSON Schema through
Kafka (its finished text validates), an invalid one (one `rejected` event, one DLQ
record with the library's message), and the official `openai` client through the gateway:
`response_format` json_schema / json_object, a forced tool call (named and `required`),
streamed and not, `beta.chat.completions.parse` with a Pydantic model, and a tool-calling
history rendered by the chat template."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pydantic
from aiokafka import AIOKafkaConsumer

from schemas import keys
from schemas.params import JsonSchemaOutput, RegexOutput, SamplingParams
from tests.integration.conftest import worker_config
from tests.integration.gateway_helpers import MODEL, client, gateway_config, running_gateway, sample
from tests.integration.helpers import assert_well_formed, collect, running_worker
from worker.client import InflightClient

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 50},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["city", "rank", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Tell me about a city"}]


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=10)
    population: int = pydantic.Field(ge=0, le=10_000)


async def _dead_letters(bootstrap: str, prefix: str, n: int) -> list:
    dlq = AIOKafkaConsumer(keys.dlq_topic(prefix), bootstrap_servers=bootstrap, group_id=None,
                           auto_offset_reset="earliest")
    await dlq.start()
    dead = []
    try:
        for _ in range(40):
            batch = await dlq.getmany(timeout_ms=500)
            dead.extend(r for rs in batch.values() for r in rs)
            if len(dead) >= n:
                break
    finally:
        await dlq.stop()
    return dead


async def _stream(stream) -> tuple[str, dict, str | None]:
    """(content, tool calls assembled by index, finish reason) of a streamed chat completion."""
    text, calls, reason = "", {}, None
    async for ch in stream:
        for c in ch.choices:
            text += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["name"] = tc.function.name or slot["name"]
                    slot["arguments"] += tc.function.arguments or ""
            reason = c.finish_reason or reason
    return text, calls, reason


def test_structured_jobs_through_kafka_and_the_openai_client(services, prefix, llama_path, tmp_path):
    # the engine core in its own process, as `inflight worker` runs it: grammars cross the pipe
    cfg = worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu"},
                        worker={"engine_process": True})

    async def main():
        out = {}
        async with running_worker(cfg, None) as w, \
                running_gateway(gateway_config(services, prefix, tmp_path / "files", tokenizer=llama_path)) as gw:
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as direct:
                p = SamplingParams(max_tokens=120, temperature=1.0, seed=5, structured=JsonSchemaOutput(schema=SCHEMA))
                out["job"] = await collect(direct, await direct.submit("A city:", params=p, job_id="schema-job"), 60)
                bad = SamplingParams(max_tokens=20, structured=RegexOutput(pattern="(unclosed"))
                out["bad"] = await collect(direct, await direct.submit("x", params=bad, job_id="bad-regex"), 60)
            out["dead"] = await _dead_letters(services[0], prefix, 1)
            c = client(gw)
            base = dict(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0.8, seed=3)
            fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
            out["schema"] = await c.chat.completions.create(**base, response_format=fmt)
            out["schema_stream"] = await _stream(await c.chat.completions.create(**base, response_format=fmt,
                                                                                 stream=True))
            out["object"] = await c.completions.create(model=MODEL, prompt="JSON:", max_tokens=120, temperature=0.8,
                                                       seed=4, extra_body={"response_format": {"type": "json_object"}})
            named = {"type": "function", "function": {"name": "get_weather"}}
            out["named"] = await c.chat.completions.create(**base, tools=[WEATHER, TIME], tool_choice=named)
            out["named_stream"] = await _stream(await c.chat.completions.create(
                **base, tools=[WEATHER, TIME], tool_choice=named, stream=True))
            out["required"] = await c.chat.completions.create(**base, tools=[WEATHER, TIME], tool_choice="required",
                                                              parallel_tool_calls=False)
            out["required_stream"] = await _stream(await c.chat.completions.create(
                **base, tools=[WEATHER, TIME], tool_choice="required", stream=True))
            out["parsed"] = await c.beta.chat.completions.parse(**base, response_format=City)
            history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
            out["history"] = await c.chat.completions.create(model=MODEL, messages=history, max_tokens=5,
                                                             tools=[TIME], tool_choice="none", temperature=0)
            out["errors"] = {}
            for name, kw in (("auto", {"tools": [WEATHER]}),
                             ("unknown_fn", {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                                 "function": {"name": "nope"}}}),
                             ("bad_schema", {"response_format": {"type": "json_schema", "json_schema": {
                                 "name": "x", "schema": {"type": "frobnicate"}}}}),
                             ("bad_type", {"response_format": {"type": "xml"}})):
                try:
                    await c.chat.completions.create(**base, **kw)
                except openai.BadRequestError as e:
                    out["errors"][name] = (e.status_code, e.body.get("param"), e.body.get("code"), e.message)
            out["metrics"] = {"cache": sample(w.metrics.registry, "structured_output_grammar_cache_total",
                                              result="hit") + sample(w.metrics.registry,
                                                                     "structured_output_grammar_cache_total",
                                                                     result="miss"),
                              "compiles": sample(w.metrics.registry,
                                                 "structured_output_compile_seconds_count"),
                              "rejected": sample(w.metrics.registry, "request_rejected_total",
                                                 reason="invalid_structured_output")}
        return out

    out = asyncio.run(main())
    fin = assert_well_formed(out["job"], "schema-job")
    assert fin.finish_reason == "stop"
    jsonschema.validate(json.loads(fin.text), SCHEMA)
    bad = assert_well_formed(out["bad"], "bad-regex")
    assert len(out["bad"]) == 1 and bad.finish_reason == "rejected"
    assert bad.error.code == "invalid_structured_output" and "unclosed" in bad.error.message
    assert [r.key for r in out["dead"]] == [b"bad-regex"]
    assert dict(out["dead"][0].headers)["inflight.reason"] == b"invalid_structured_output"

    msg = out["schema"].choices[0]
    assert msg.finish_reason == "stop"
    jsonschema.validate(json.loads(msg.message.content), SCHEMA)
    s_text, _, s_reason = out["schema_stream"]
    assert s_text == msg.message.content and s_reason == "stop"  # same seed, same tokens
    obj = out["object"].choices[0]  # any object: a random model may write one longer than max_tokens
    assert isinstance(json.loads(obj.text), dict) if obj.finish_reason == "stop" else obj.text.startswith("{")

    named = out["named"].choices[0]
    assert named.finish_reason == "tool_calls" and named.message.content is None
    (call,) = named.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    _, calls, reason = out["named_stream"]
    assert reason == "tool_calls" and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == call.function.arguments

    req = out["required"].choices[0]
    assert req.finish_reason == "tool_calls" and len(req.message.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for tc in req.message.tool_calls:
        jsonschema.validate(json.loads(tc.function.arguments), schemas[tc.function.name])
    _, calls, reason = out["required_stream"]
    assert reason == "tool_calls" and calls
    for tc in calls.values():
        jsonschema.validate(json.loads(tc["arguments"]), schemas[tc["name"]])

    parsed = out["parsed"].choices[0].message.parsed
    assert isinstance(parsed, City) and 0 <= parsed.population <= 10_000
    assert out["history"].choices[0].finish_reason in ("stop", "length")

    errs = out["errors"]
    assert errs["auto"][:2] == (400, "tool_choice") and "required" in errs["auto"][3]
    assert errs["unknown_fn"][:2] == (400, "tool_choice.function.name")
    assert errs["bad_schema"][0] == 400 and "frobnicate" in errs["bad_schema"][3]
    assert errs["bad_type"][:2] == (400, "response_format.type")
    m = out["metrics"]
    assert m["cache"] >= 8 and m["compiles"] >= 4 and m["rejected"] >= 1
