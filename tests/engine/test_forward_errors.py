"""An exception in a forward ends only the requests that cause it (issue 10, case 3):
the batch is retried split, a request that fails alone ends `finished(error, internal)`,
everyone else gets the tokens of a clean run, and the engine keeps serving."""

from __future__ import annotations

import pytest

from schemas.params import SamplingParams
from tests.engine.test_metrics_oom import make_engine, value
from worker.engine import Engine
from worker.engine.outputs import StepSkipped
from worker.obs.metrics import Metrics

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
POISON = 499  # a token id that, in a forward's input, makes the model raise


class FailingLayer:
    """A pre-hook on the model's second decoder layer: it raises RuntimeError in the
    middle of the forward (after layer 0 wrote its KV), on the given forward numbers
    (1-based) or whenever the forward's input holds `poison`."""

    def __init__(self, engine: Engine, fail_on: set[int] = frozenset(), poison: int | None = None) -> None:
        self.calls = 0
        self.fail_on = fail_on
        self.poison = poison
        self._poisoned = False
        model = engine.runner.model.model
        model.embed_tokens.register_forward_pre_hook(self._seen)
        model.layers[1].register_forward_pre_hook(self._maybe_raise)

    def _seen(self, module, args) -> None:
        self.calls += 1
        self._poisoned = self.poison is not None and bool((args[0] == self.poison).any())

    def _maybe_raise(self, module, args) -> None:
        if self.calls in self.fail_on or self._poisoned:
            raise RuntimeError(f"injected failure in forward {self.calls}\nsecond line of the message")


def run(engine: Engine, m: Metrics, work: list[tuple[str, list[int]]], stagger: int = 1) -> dict:
    """Add `work` one request per `stagger` steps, run to the end; returns id -> (terminal outputs, tokens)."""
    finals: dict[str, list] = {}
    toks: dict[str, list[int]] = {}
    step = 0
    pending = list(work)
    while pending or engine.has_unfinished():
        if pending and step % stagger == 0:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt_token_ids=prompt, params=PARAMS)
        for out in engine.step():
            toks.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals.setdefault(out.request_id, []).append(out)
        m.observe_step(engine.last_step_stats)
        engine.check_invariants()
        step += 1
    return {rid: (finals[rid], toks.get(rid, [])) for rid in finals}


PROMPTS = [("a", [5, 17, 33, 101, 7, 250] * 3), ("b", [9, 8, 7, 6] * 5), ("c", [3, 4, 5, 6, 7] * 7)]


ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sequential", "async"])


@ASYNC
def test_a_failed_forward_of_two_requests_is_retried_split_and_both_finish(llama_path, async_scheduling):
    # The input: the 4th forward raises while two requests run. With asynchronous
    # steps the step launched behind it is skipped (never computed) and taken back.
    ref = run(make_engine(llama_path), Metrics(), PROMPTS[:2], stagger=1)
    engine = make_engine(llama_path, async_scheduling=async_scheduling)
    m = Metrics()
    inj = FailingLayer(engine, fail_on={4})
    launched = []  # (step, raised) of each launched step
    real_launch = engine.runner.launch

    def launch(sched, after=None):
        handle = real_launch(sched, after)
        launched.append((sched.step, handle))
        return handle

    engine.runner.launch = launch
    res = run(engine, m, PROMPTS[:2], stagger=1)
    assert inj.calls > 6  # the failed batch, then each request alone, then the rest
    skipped = [step for step, h in launched if isinstance(h._future.exception(), StepSkipped)]
    assert len(skipped) == (1 if async_scheduling else 0)  # the step launched behind the failed one
    for rid in ("a", "b"):
        finals, toks = res[rid]
        assert len(finals) == 1 and finals[0].finish_reason == "length"
        assert toks == ref[rid][1]  # KV half-written by the failed forward was rewritten
    assert value(m, "engine_failed_forwards_total") == 1
    assert value(m, "request_errors_total", code="internal") == 0
    assert engine.kv_stats().used_blocks == 0


@ASYNC
def test_a_forward_that_fails_alone_too_ends_its_requests_and_the_engine_keeps_serving(llama_path, async_scheduling):
    engine = make_engine(llama_path, async_scheduling=async_scheduling)
    m = Metrics()
    FailingLayer(engine, fail_on={4, 5, 6})  # the batch and both lone retries
    res = run(engine, m, PROMPTS[:2], stagger=1)
    for rid in ("a", "b"):
        finals, toks = res[rid]
        assert len(finals) == 1, finals
        out = finals[0]
        assert out.finish_reason == "error" and out.error_code == "internal"
        assert out.error_message == "RuntimeError: injected failure in forward 5" or \
            out.error_message == "RuntimeError: injected failure in forward 6"
        assert out.usage.completion_tokens == len(toks) > 0  # tokens of the good steps were delivered
    assert value(m, "engine_failed_forwards_total") == 3
    assert value(m, "request_errors_total", code="internal") == 2
    assert engine.kv_stats().used_blocks == 0
    after = run(engine, m, PROMPTS[2:])
    assert after["c"][0][0].finish_reason == "length" and len(after["c"][1]) == 12


@ASYNC
def test_a_poison_request_does_not_take_its_neighbours_with_it(llama_path, async_scheduling):
    clean = run(make_engine(llama_path), Metrics(), PROMPTS, stagger=2)
    assert all(POISON not in toks for _, toks in clean.values())
    engine = make_engine(llama_path, async_scheduling=async_scheduling)
    m = Metrics()
    FailingLayer(engine, poison=POISON)
    poisoned = [PROMPTS[0], ("poison", [11, 12, POISON, 13] * 4), *PROMPTS[1:]]
    res = run(engine, m, poisoned, stagger=2)  # joins while "a" decodes; "b" and "c" join after it
    assert all(len(finals) == 1 for finals, _ in res.values()) and len(res) == 4
    out, toks = res["poison"][0][0], res["poison"][1]
    assert out.finish_reason == "error" and out.error_code == "internal" and toks == []
    assert "\n" not in out.error_message and "Traceback" not in out.error_message
    for rid, _ in PROMPTS:
        assert res[rid][0][0].finish_reason == "length"
        assert res[rid][1] == clean[rid][1]
    assert value(m, "engine_failed_forwards_total") == 2  # the mixed batch, then the poison alone
    assert value(m, "request_errors_total", code="internal") == 1
    assert engine.kv_stats().used_blocks == 0
    engine.check_invariants()
