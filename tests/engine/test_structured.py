"""Structured outputs through the real engine and the real library (llguidance): every
constrained output parses and validates (jsonschema), greedy and sampled, alone and mixed
with unconstrained requests, across chunked prefill, preemption and asynchronous steps;
unconstrained neighbours keep their tokens; compiles never hold a step."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import msgspec
import pytest

from schemas.params import (
    ChoiceOutput,
    GrammarOutput,
    JsonObjectOutput,
    JsonSchemaOutput,
    RegexOutput,
    SamplingParams,
)
from schemas.wire import FinishReason
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine
from worker.engine.request import RejectReason, RequestRejected
from worker.engine.structured import GrammarCompiler

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                  "id": {"type": "integer", "minimum": -999, "maximum": 999}},
                 "required": ["name", "id"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
               "minItems": 2, "maxItems": 4}}, "required": ["xs"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        # multipleOf bounds the digits: a weak model may repeat fraction digits to max_tokens
        "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125}},
        "required": ["age", "score"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999}, "b": {"type": "string", "maxLength": 5},
                                                  "c": {"type": "boolean"}},
                 "required": ["a"], "additionalProperties": False},
    "ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -999, "maximum": 999}, "y": {"type": "integer", "minimum": -999, "maximum": 999}},
                                "required": ["x", "y"], "additionalProperties": False}},
            "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
            "required": ["from", "to"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["code", "zip"], "additionalProperties": False},
}
PROMPTS = ["Return the record:", "The answer is", "JSON please", "Q: what is it?\nA:"]


def make_engine(path, **tuning) -> Engine:
    t = dict(max_total_tokens=8192, max_batched_tokens=256, max_running_requests=32, max_input_tokens=512)
    t.update(tuning)
    cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=ServingTuning(**t))
    return Engine.from_pretrained(str(path), cfg)


@pytest.fixture(scope="module")
def engine(llama_path):
    return make_engine(llama_path)


def constrained(schema, *, seed: int | None = None, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 1.0, seed=seed,
                          structured=JsonSchemaOutput(schema=schema))


def check_json(out, schema) -> None:
    assert out.finish_reason == FinishReason.STOP, (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_schema_greedy_and_sampled_outputs_validate(engine, name):
    schema = SCHEMAS[name]
    params = [constrained(schema)] + [constrained(schema, seed=s) for s in range(5)]
    outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    for out in outs:
        check_json(out, schema)
    assert " " not in outs[0].text.replace('" "', "").split('"')[0]  # compact: no whitespace between tokens


@pytest.mark.parametrize("async_steps", [False, True])
def test_mixed_batch_with_chunked_prefill_keeps_unconstrained_tokens(llama_path, async_steps):
    """Constrained and unconstrained requests in one batch, prompts longer than the step
    budget (chunked prefill): every constrained output validates and every unconstrained
    request produces exactly the tokens it produces alone."""
    eng = make_engine(llama_path, max_batched_tokens=64, async_scheduling=async_steps)
    long_prompt = [(7 * j) % 500 + 1 for j in range(150)]  # > 64: three chunks
    plain = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)]
    alone = eng.generate([long_prompt, long_prompt[:40]], plain)
    names = sorted(SCHEMAS)
    params = [constrained(SCHEMAS[n], seed=None if i % 2 else i) for i, n in enumerate(names)]
    prompts = [long_prompt if i % 2 else long_prompt[: 20 + i] for i in range(len(names))]
    outs = eng.generate([long_prompt, long_prompt[:40], *prompts], [*plain, *params])
    assert [o.token_ids for o in outs[:2]] == [a.token_ids for a in alone]
    for n, out in zip(names, outs[2:]):
        check_json(out, SCHEMAS[n])


def test_constrained_requests_survive_preemption(llama_path):
    """A KV cache too small for the batch: requests are preempted and recomputed; their
    matchers stay at the kept tokens, so every output still validates. Every answer holds
    a string of 30-60 characters, so each request outgrows its first three blocks whatever
    its seed draws: 12 of them cannot all fit in 40 blocks."""
    eng = make_engine(llama_path, max_total_tokens=640, kv_block_size=16, max_batched_tokens=128)
    schema = SCHEMAS["optional"] | {"properties": {**SCHEMAS["optional"]["properties"],
                                                   "b": {"type": "string", "minLength": 30, "maxLength": 60}},
                                    "required": ["a", "b"]}
    params = [constrained(schema, seed=s, max_tokens=90) for s in range(12)]
    prompts = [[(3 * i + j) % 500 + 1 for j in range(40)] for i in range(12)]
    rids = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"p{i}", prompt_token_ids=p, params=sp)
        rids.append(f"p{i}")
    texts = {r: "" for r in rids}
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            texts[o.request_id] += o.text
            if o.finished:
                finals[o.request_id] = o
    assert eng.scheduler.num_preemptions_total > 0
    assert any(f.num_preemptions for f in finals.values())
    for r in rids:
        assert finals[r].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if finals[r].finish_reason == FinishReason.STOP:
            jsonschema.validate(json.loads(texts[r]), schema)
        else:  # cut by max_tokens: still a valid prefix (never a token the grammar refused)
            assert texts[r].startswith("{")
    assert sum(f.finish_reason == FinishReason.STOP for f in finals.values()) >= 6


def test_regex_choice_grammar_and_json_object(engine):
    choices = ["yes", "no", 'maybe "so"', "naïve\\path"]
    params = ([SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured=ChoiceOutput(choices=choices))
               for s in range(8)]
              + [SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                structured=RegexOutput(pattern=r"[0-9]{3}-[a-z]{2,4}")) for s in range(8)]
              + [SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                structured=GrammarOutput(grammar='start: "(" num ("," num)* ")"\nnum: /[1-9][0-9]?/'))
                 for s in range(4)]
              + [SamplingParams(max_tokens=120, temperature=0.7, seed=s, structured=JsonObjectOutput())
                 for s in range(4)])
    outs = engine.generate(["Pick one:"] * len(params), params)
    for o in outs[:8]:
        assert o.finish_reason == FinishReason.STOP and o.text in choices
    for o in outs[8:16]:
        assert o.finish_reason == FinishReason.STOP and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.text, re.ASCII), o.text
    for o in outs[16:20]:
        assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", o.text) or o.finish_reason == FinishReason.LENGTH
    for o in outs[20:]:
        if o.finish_reason == FinishReason.STOP:
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.startswith("{")


def test_a_held_back_stop_string_start_still_advances_the_grammar(engine):
    """`X` may begin the stop string `XY`, so its text is held back; the grammar has
    consumed it anyway and the output ends with the whole choice (no stop string)."""
    p = SamplingParams(max_tokens=30, temperature=0.0, stop=["XY"], structured=ChoiceOutput(choices=["aXb-c"]))
    out = engine.generate(["go"], p)[0]
    assert out.text == "aXb-c" and out.finish_reason == FinishReason.STOP


def test_logprobs_are_of_the_masked_distribution(engine):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=5, structured=ChoiceOutput(choices=["ab", "ac"]))
    out = engine.generate(["x"], p)[0]
    assert out.text in ("ab", "ac")
    for lp in out.logprobs:
        assert all(v > float("-inf") for v in lp.top_logprobs)
        assert sum(2.718281828 ** v for v in lp.top_logprobs) <= 1.0 + 1e-4
        assert lp.token_id in lp.top_token_ids or len(lp.top_token_ids) == 5


@pytest.mark.parametrize("structured, needle", [
    (JsonSchemaOutput(schema={"type": "frobnicate"}), "frob"),
    (JsonSchemaOutput(schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
    (RegexOutput(pattern="a(b"), "unclosed"),
    (GrammarOutput(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_invalid_constraints_are_rejected_with_the_library_message(engine, structured, needle):
    with pytest.raises(RequestRejected) as e:
        engine.add_request("bad", prompt="x", params=SamplingParams(max_tokens=5, structured=structured))
    assert e.value.reason == RejectReason.INVALID_STRUCTURED_OUTPUT
    assert needle in e.value.message
    assert not engine.has_unfinished()


def test_a_constraint_over_the_size_bound_is_rejected_not_compiled(llama_path):
    eng = make_engine(llama_path, max_structured_output_bytes=2000)
    big = {"type": "object", "properties": {f"field_{i}": {"type": "integer", "minimum": -999, "maximum": 999} for i in range(200)}}
    with pytest.raises(RequestRejected) as e:
        eng.add_request("big", prompt="x", params=SamplingParams(structured=JsonSchemaOutput(schema=big)))
    assert e.value.reason == RejectReason.INVALID_STRUCTURED_OUTPUT
    assert "max_structured_output_bytes" in e.value.message


def test_unknown_constraint_type_fails_decoding_with_the_allowed_tags():
    with pytest.raises(msgspec.ValidationError) as e:
        msgspec.json.decode(b'{"structured": {"type": "xml"}}', type=SamplingParams)
    assert "xml" in str(e.value) and "structured" in str(e.value)


class _GatedCompiler(GrammarCompiler):
    """A compiler whose compiles wait for `gate`: a compile as slow as a test wants."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def _compile(self, grammar):
        assert self.gate.wait(30)
        return super()._compile(grammar)


def test_steps_go_on_while_a_grammar_compiles_and_the_cache_compiles_once(llama_path):
    eng = make_engine(llama_path)
    loaded = eng.loaded
    gated = _GatedCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    eng.core.arrivals.compiling.compiler = gated
    schema = SCHEMAS["enum"]
    eng.add_request("plain", prompt="hello", params=SamplingParams(max_tokens=20, ignore_eos=True))
    for i in range(10):
        eng.add_request(f"c{i}", prompt="hello", params=constrained(schema, seed=i))
    steps_before = plain_tokens = hits = misses = 0
    compile_s = []

    def count(st):
        nonlocal hits, misses
        hits, misses = hits + st.grammar_cache_hits, misses + st.grammar_cache_misses
        compile_s.extend(st.grammar_compile_s)

    while plain_tokens < 20:
        for o in eng.step():
            assert o.request_id == "plain"  # nothing constrained runs before its grammar is ready
            plain_tokens += len(o.new_token_ids)
        steps_before += 1
        count(eng.last_step_stats)
    assert steps_before >= 20 and eng.last_step_stats.num_constrained == 10
    gated.gate.set()
    texts = {f"c{i}": "" for i in range(10)}
    while eng.has_unfinished():
        for o in eng.step():
            texts[o.request_id] += o.text
        count(eng.last_step_stats)
    for t in texts.values():
        jsonschema.validate(json.loads(t), schema)
    assert (misses, hits, len(compile_s)) == (1, 9, 1)


def test_abort_and_deadline_reach_a_request_waiting_for_its_grammar(llama_path):
    import time

    eng = make_engine(llama_path)
    loaded = eng.loaded
    gated = _GatedCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    eng.core.arrivals.compiling.compiler = gated
    eng.add_request("cancel-me", prompt="x", params=constrained(SCHEMAS["enum"]))
    eng.add_request("expire-me", prompt="x", params=constrained(SCHEMAS["enum"]), deadline=time.time() + 0.05)
    outs = eng.step()
    eng.abort("cancel-me")
    time.sleep(0.1)
    outs += eng.step()
    reasons = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert reasons == {"cancel-me": FinishReason.CANCELLED, "expire-me": FinishReason.EXPIRED}
    assert not eng.has_unfinished()
    gated.gate.set()


def test_the_device_unpack_equals_the_host_unpack():
    """The CUDA path expands bits on the device; on the CPU numpy does: same mask."""
    import numpy as np
    import torch

    from worker.model.masks import unpack_on_device

    bm = np.random.default_rng(0).integers(-2**31, 2**31 - 1, size=(5, 9), dtype=np.int64).astype(np.int32)
    host = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")[:, :270]
    assert torch.equal(unpack_on_device(bm, 270, torch.device("cpu")), torch.from_numpy(host).bool())
    assert unpack_on_device(bm, 270, torch.device("cpu"))[0, 0].item() == bool(bm[0, 0] & 1)


def test_strict_schemas_hold_only_the_named_properties(engine):
    """Found trying the CLI as a new user: a schema without `additionalProperties` let the
    model add keys of its own (`{"name":…,"pop":0,":////…`) until max_tokens. Strict (the
    default, as OpenAI's strict mode) closes every object that names properties."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "inner": {"type": "object", "properties": {
                                                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                                   "required": ["n"]}},
              "required": ["name", "inner"]}
    closed = json.loads(json.dumps(schema))
    closed["additionalProperties"] = False
    closed["properties"]["inner"]["additionalProperties"] = False
    outs = engine.generate(PROMPTS * 2, [constrained(schema, seed=s) for s in range(8)])
    for out in outs:
        check_json(out, closed)
    from schemas.structured import grammar_of

    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert '"additionalProperties":false' in grammar_of(JsonSchemaOutput(schema=open_schema), 65536)
    assert "additionalProperties" not in grammar_of(JsonSchemaOutput(schema=open_schema, strict=False), 65536)
