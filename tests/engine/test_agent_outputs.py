"""Constrained "auto" tool calls on real generations: the agent model
(tools/make_agent_model.py) sampled hot, through the engine with the gateway's grammar
for its family (`worker.gateway.agents.tool_call_grammar`): every call it opens and
completes parses and validates against its tool's schema; without the grammar, the same
requests produce broken calls (so the check can fail). tools.bench.agents measures the
same over 500 requests per setting."""

from __future__ import annotations

import pytest

from tools.bench.agents import FUNCTIONS, judge, run_validity
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine


@pytest.fixture(scope="module")
def agent_engine(agent_path):
    return Engine.from_pretrained(str(agent_path), EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu"),
        serving_tuning=ServingTuning(max_running_requests=32, max_total_tokens=16384, max_batched_tokens=2048)))


def test_every_complete_constrained_call_validates_and_free_calls_do_not(agent_engine):
    assert set(FUNCTIONS) == {"get_weather", "get_time"}
    constrained, _ = run_validity(agent_engine, 200, 1.5, constrained=True)
    free, _ = run_validity(agent_engine, 200, 1.5, constrained=False)
    assert constrained["opened_calls"] >= 40 and free["opened_calls"] >= 40
    kinds = constrained["failure_kinds"]
    assert set(kinds) <= {"cut by max_tokens"}, constrained["failure_examples"]
    assert sum(n for k, n in free["failure_kinds"].items() if k != "cut by max_tokens") >= 10


def test_the_judge_tells_calls_apart():
    good = '<think>x</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert judge(good) == (True, None)
    assert judge(good.replace('"Paris"', "3")) == (True, "arguments: 3 is not of type 'string'")
    assert judge("<think>x</think>\n\nHello!") == (False, None)
    assert judge(good.replace("get_weather", "get_rain"))[1] == "unknown tool 'get_rain'"


def test_chat_template_kwargs_reach_the_template(llama_path):
    """A job's `chat_template_kwargs` (the gateway's `reasoning_effort`) are variables of
    the chat template; a template without them renders as before."""
    from schemas.params import SamplingParams

    engine = Engine.from_pretrained(str(llama_path), EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=ServingTuning(max_running_requests=2)))
    tok = engine.input.tokenizer
    plain = tok.chat_template
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %} effort {{ reasoning_effort | default('') }}"

    def prompt(rid: str, **kw) -> str:
        engine.add_request(rid, messages=[{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=4, temperature=0), **kw)
        engine.step()
        ids = engine.scheduler.requests[rid].all_token_ids[:engine.scheduler.requests[rid].num_prompt_tokens]
        while engine.has_unfinished():
            engine.step()
        return tok.decode(ids)

    try:
        assert prompt("low", template_kwargs={"reasoning_effort": "low"}).endswith("effort low")
        assert prompt("none").endswith("effort ")
    finally:
        tok.chat_template = plain
