"""Engine-side metrics (per-step gauges, preemption counts) and out-of-memory handling."""

from __future__ import annotations

import random

import pytest
import torch

from schemas.params import SamplingParams
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine
from worker.obs.metrics import Metrics


def make_engine(path, **tuning) -> Engine:
    t = dict(max_running_requests=8, max_total_tokens=256, kv_block_size=16, max_batched_tokens=64,
             max_output_tokens=64)
    t.update(tuning)
    cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=ServingTuning(**t))
    return Engine.from_pretrained(str(path), cfg)


def value(m: Metrics, name: str, **labels) -> float:
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_step_gauges_follow_the_kv_manager_and_preemptions_are_counted(llama_path):
    engine = make_engine(llama_path)  # 16 blocks of 16 tokens: 8 requests of ~60 tokens must preempt
    m = Metrics()
    rng = random.Random(0)
    for i in range(8):
        engine.add_request(f"r{i}", prompt_token_ids=[rng.randrange(3, 500) for _ in range(rng.randint(10, 30))],
                           params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    delivered = {f"r{i}": 0 for i in range(8)}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            delivered[out.request_id] += len(out.new_token_ids)
        m.observe_step(engine.last_step_stats)
        steps += 1
        kv = engine.kv.stats()
        assert value(m, "kv_cache_usage_ratio") == pytest.approx(kv.used_blocks / kv.total_blocks)
        assert value(m, "running_requests") == engine.scheduler.num_running
        assert value(m, "waiting_requests") == engine.scheduler.num_waiting
    assert engine.scheduler.num_preemptions_total > 0, "the scenario must force preemption"
    assert value(m, "preemptions_total") == engine.scheduler.num_preemptions_total
    assert value(m, "kv_cache_usage_ratio") == 0.0  # idle: every block back
    # no double count: recomputed tokens are prefill work, never new output
    assert sum(delivered.values()) == 8 * 40
    assert value(m, "engine_step_duration_seconds_count") == steps
    assert value(m, "decode_tokens_per_second") > 0


class OOMInjector:
    """Wraps `runner.execute`; raises torch.OutOfMemoryError (what CUDA raises) on the
    given call numbers (1-based), like a real allocation failure inside the forward."""

    def __init__(self, engine: Engine, fail_on: set[int]) -> None:
        self.calls = 0
        self.fail_on = fail_on
        self._execute = engine.runner.execute
        engine.runner.execute = self

    def __call__(self, sched):
        self.calls += 1
        if self.calls in self.fail_on:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self._execute(sched)


def run_all(engine: Engine, m: Metrics) -> dict:
    outs = {}
    toks: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            toks.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                outs[out.request_id] = out
        m.observe_step(engine.last_step_stats)
    return {rid: (o, toks.get(rid, [])) for rid, o in outs.items()}


def test_oom_retries_then_succeeds_with_the_same_tokens(llama_path):
    prompts = [[5 + i, 17, 33, 101 + i, 7, 250] * 3 for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = make_engine(llama_path).generate(prompts, params)
    engine = make_engine(llama_path, max_oom_retries=1)
    m = Metrics()
    inj = OOMInjector(engine, fail_on={3})  # a decode step of all four requests
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
    res = run_all(engine, m)
    assert inj.calls > 3
    for i, r in enumerate(ref):
        out, toks = res[f"r{i}"]
        assert out.finish_reason == "length"
        assert toks == r.token_ids  # recomputed after the OOM: same greedy tokens, none repeated
    assert value(m, "request_oom_total", outcome="retried") == 4
    assert value(m, "request_oom_total", outcome="failed") == 0
    assert engine.kv_stats().used_blocks == 0
    engine.check_invariants()


def test_oom_fails_the_batch_frees_blocks_and_keeps_serving(llama_path):
    engine = make_engine(llama_path, max_oom_retries=0)
    m = Metrics()
    OOMInjector(engine, fail_on={2})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", prompt_token_ids=[9, 8, 7, 6 + i] * 5, params=params)
    res = run_all(engine, m)
    for i in range(3):
        out, toks = res[f"r{i}"]
        assert out.finish_reason == "error" and out.error_code == "oom", out
        assert "out of memory" in out.error_message
        assert out.usage.completion_tokens == len(toks) == 1  # the token of step 1 was delivered
    assert value(m, "request_oom_total", outcome="failed") == 3
    assert engine.kv_stats().used_blocks == 0 and value(m, "kv_cache_usage_ratio") == 0
    engine.check_invariants()
    # the engine keeps serving: the next request runs to completion (budget backed off, then recovers)
    engine.add_request("after", prompt_token_ids=[1, 2, 3, 4] * 10, params=params)
    res = run_all(engine, m)
    assert res["after"][0].finish_reason == "length" and len(res["after"][1]) == 10


def test_waiting_request_expires_at_its_deadline(llama_path):
    import time

    engine = make_engine(llama_path, max_running_requests=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("busy", prompt_token_ids=[5, 6, 7], params=params)
    engine.add_request("late", prompt_token_ids=[8, 9], params=params, deadline=time.time() + 0.3)
    engine.add_request("started", prompt_token_ids=[8, 9], params=params, deadline=time.time() + 3600)
    outs = {}
    t0 = time.time()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = (out, time.time() - t0)
        time.sleep(0.01)
    late, when = outs["late"]
    assert late.finish_reason == "expired" and late.error_code == "deadline_passed"
    assert late.usage.completion_tokens == 0 and 0.3 <= when < outs["busy"][1]  # while "busy" still ran
    assert outs["busy"][0].finish_reason == "length" and outs["started"][0].finish_reason == "length"
    assert engine.kv_stats().used_blocks == 0
