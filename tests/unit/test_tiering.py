"""Prompt-length tiering (worker/engine/tiering.py) on a NullRunner: the per-step cap on
long prompts' prefill tokens, short prompts admitted past long ones, same tokens with and
without the cap, counters, config errors."""

from __future__ import annotations

import pytest

from schemas.params import SamplingParams
from worker.config import ConfigError, EngineConfig, ServingTuning
from worker.engine import KVStats, StepStats
from worker.model.null_runner import null_engine
from worker.obs.metrics import Metrics

LONG, SHORT, CAP, THRESHOLD = 200, 8, 32, 64


def engine(tiering: bool, async_scheduling: bool = False):
    extra = {"long_prefill_threshold": THRESHOLD, "max_long_prefill_tokens": CAP} if tiering else {}
    tuning = ServingTuning(max_batched_tokens=256, max_running_requests=16, kv_block_size=4, max_total_tokens=4096,
                           async_scheduling=async_scheduling, **extra)
    return null_engine(EngineConfig(serving_tuning=tuning), vocab_size=100, max_model_len=1024)


def run_stream(eng, num_short: int = 12) -> tuple[dict[str, list[int]], dict[str, int], list[int]]:
    """Three long prompts at step 0, then one short prompt before each step (ids apart
    from the long prompts', so no prefix is cached across them). Returns
    the ids per request, each short request's wait in steps (added -> first token), and
    each scheduled step's long-prefill tokens."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"long-{i}", prompt_token_ids=[1 + (i + j) % 90 for j in range(LONG)], params=params)
    ids: dict[str, list[int]] = {}
    added: dict[str, int] = {}
    waited: dict[str, int] = {}
    long_tokens: list[int] = []
    sched, longs = eng.core.scheduler, eng.core.scheduler.long_prefills
    schedule = sched.schedule

    def counted(*args, **kwargs):  # per schedule: an asynchronous engine call may schedule two steps
        before = longs.num_tokens_total
        out = schedule(*args, **kwargs)
        long_tokens.append(longs.num_tokens_total - before)
        return out

    sched.schedule = counted
    step = 0
    while eng.has_unfinished() or step < num_short:
        if step < num_short:
            rid = f"short-{step}"
            eng.add_request(rid, prompt_token_ids=[91 + (step + j) % 8 for j in range(SHORT)], params=params)
            added[rid] = step
        for out in eng.step():
            if out.request_id.startswith("short") and out.request_id not in waited and out.new_token_ids:
                waited[out.request_id] = step - added[out.request_id]
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)
        eng.check_invariants()
        step += 1
        assert step < 1000
    return ids, waited, long_tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_long_prefills_share_the_cap_and_short_prompts_start_past_them(async_scheduling):
    ids, waited, long_tokens = run_stream(engine(True, async_scheduling))
    assert max(long_tokens) == CAP and all(t <= CAP for t in long_tokens)
    assert sum(long_tokens) == 3 * LONG  # every long prompt prefilled once, in chunks of the cap
    bound = 0 if not async_scheduling else 1  # a step run ahead delivers its token one call later
    assert len(waited) == 12 and max(waited.values()) <= bound, waited  # none waited behind a long prompt
    assert all(len(ids[f"long-{i}"]) == 4 for i in range(3))


def test_without_the_cap_a_long_prefill_takes_the_step_and_short_prompts_wait():
    _, waited, long_tokens = run_stream(engine(False))
    assert sum(long_tokens) == 0  # nothing counts as long without a threshold
    assert max(waited.values()) >= 1, waited  # the step the long prompts filled admitted none of them


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_cap_changes_when_tokens_come_not_which(async_scheduling):
    with_cap, _, _ = run_stream(engine(True, async_scheduling))
    without, _, _ = run_stream(engine(False, async_scheduling))
    assert with_cap == without


def test_the_counters_reach_the_metrics():
    eng = engine(True)
    run_stream(eng, num_short=2)
    sched = eng.core.scheduler.long_prefills
    assert sched.num_tokens_total == 3 * LONG and sched.num_capped_total >= 3 * LONG // CAP
    m = Metrics()
    kv = KVStats(total_blocks=10, used_blocks=0, free_blocks=10, cached_blocks=0, block_size=4)
    m.observe_step(StepStats(step=1, time=0.0, duration_s=0.01, num_running=1, num_waiting=0, num_prefill_tokens=32,
                             num_decode_tokens=0, num_preemptions=0, num_oom_retried=0, num_oom_failed=0, kv=kv,
                             num_long_prefill_capped=2, num_long_prefill_tokens=32))
    assert m.registry.get_sample_value("long_prefill_capped_total") == 2
    assert m.registry.get_sample_value("long_prefill_tokens_total") == 32


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_long_prefill_tokens": 64}, "max_long_prefill_tokens needs serving_tuning.long_prefill_threshold"),
    ({"long_prefill_threshold": 0}, "long_prefill_threshold must be >= 1"),
    ({"long_prefill_threshold": 64, "max_long_prefill_tokens": 0}, "max_long_prefill_tokens must be >= 1"),
])
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        ServingTuning(**fields)


def test_the_cap_defaults_to_the_threshold():
    assert ServingTuning(long_prefill_threshold=512).long_prefill_cap == 512
    assert ServingTuning().long_prefill_cap is None


def test_a_spent_cap_passes_over_the_waiting_long_prompts_without_visiting_them(monkeypatch):
    """200 long prompts wait behind the cap: each step admission takes the short prompts
    out of their queue, never the long ones one by one (they wait in their own heap per
    tenant; before, each was popped, deferred and pushed back in every step: schedule()
    took 0.48 ms per step against 0.045 ms now, tools/bench/admission.py)."""
    from worker.engine.fair_share import ClassQueue

    eng = engine(True)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(200):
        eng.add_request(f"long-{i}", prompt_token_ids=[1 + (i + j) % 90 for j in range(LONG)], params=params)
    popped: list[str] = []
    real_pop = ClassQueue.pop
    monkeypatch.setattr(ClassQueue, "pop", lambda self, req: (popped.append(req.request_id), real_pop(self, req)))
    longs = eng.core.scheduler.long_prefills
    for step in range(20):
        eng.add_request(f"short-{step}", prompt_token_ids=[91 + (step + j) % 8 for j in range(SHORT)], params=params)
        capped_before = longs.num_capped_total
        popped.clear()
        eng.step()
        eng.check_invariants()
        assert f"short-{step}" in popped  # the short prompt started in its arrival step
        assert sum(p.startswith("long") for p in popped) <= 1, popped  # at most the one the cap admits
        assert longs.num_capped_total - capped_before >= 190  # the passed-over ones still count
