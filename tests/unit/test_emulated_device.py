"""The emulated asynchronous device of the null engine and the device busy accounting
(`engine_device_busy_ratio`): launching returns at once, a second launch queues behind
the first, busy time counts only what has run, and the metric is busy / wall."""

from __future__ import annotations

import time

import pytest

from schemas.params import SamplingParams
from worker.config import EngineConfig, ServingTuning
from worker.model.null_runner import EmulatedDevice, null_engine
from worker.obs.metrics import Metrics


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_launch_returns_at_once_and_a_second_launch_queues_behind_the_first():
    clock = FakeClock()
    dev = EmulatedDevice(0.002, clock=clock)
    assert dev.launch() == pytest.approx(100.002)
    assert dev.launch() == pytest.approx(100.004)  # queued behind the first, not at now + 2 ms
    assert dev.busy_s() == pytest.approx(0.0)  # nothing has run yet
    clock.t = 100.003
    assert dev.busy_s() == pytest.approx(0.003)  # the first and half of the second
    clock.t = 101.0
    assert dev.busy_s() == pytest.approx(0.004)  # idle since: busy time stands still
    assert dev.launch() == pytest.approx(101.002)  # an idle device starts at once
    assert dev.num_steps == 3


def test_wait_sleeps_until_the_result_is_ready():
    dev = EmulatedDevice(0.02)
    t0 = time.perf_counter()
    ready = dev.launch()
    assert time.perf_counter() - t0 < 0.01  # launching does not wait
    dev.wait(ready)
    assert time.perf_counter() >= ready


def test_engine_steps_account_device_busy_time():
    cfg = EngineConfig(serving_tuning=ServingTuning(max_running_requests=4, max_total_tokens=1024,
                                                    max_batched_tokens=64))
    eng = null_engine(cfg, max_model_len=256, device_ms=5)
    for i in range(4):
        eng.add_request(f"r{i}", prompt_token_ids=[5 + i, 6, 7], params=SamplingParams(max_tokens=8, ignore_eos=True))
    t0 = time.perf_counter()
    steps = 0
    busy = []
    while eng.has_unfinished():
        eng.step()
        steps += 1
        busy.append(eng.last_step_stats.device_busy_s)
    wall = time.perf_counter() - t0
    assert busy == sorted(busy) and busy[-1] == pytest.approx(steps * 0.005, rel=0.01)
    assert busy[-1] <= wall  # a sequential core never overlaps: busy <= wall
    no_device = null_engine(cfg, max_model_len=256)
    no_device.add_request("x", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=2, ignore_eos=True))
    no_device.step()
    assert no_device.last_step_stats.device_busy_s == 0.0


def test_busy_ratio_metric_is_busy_over_wall_in_the_window(monkeypatch):
    import worker.obs.metrics as metrics_mod

    now = [1000.0]
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: now[0])
    m = Metrics(throughput_window_s=10.0)
    stats = null_engine(max_model_len=64)
    stats.add_request("x", prompt_token_ids=[5], params=SamplingParams(max_tokens=1, ignore_eos=True))
    stats.step()
    base = stats.last_step_stats

    def observe(busy: float) -> float:
        m.observe_step(type(base)(**{**{f: getattr(base, f) for f in base.__struct_fields__}, "device_busy_s": busy}))
        return m.device_busy._value.get()

    observe(0.0)
    now[0] += 1.0
    assert observe(0.25) == pytest.approx(0.25)
    now[0] += 1.0
    assert observe(1.25) == pytest.approx(0.625)  # 1.25 s busy in 2 s
    now[0] += 2.0
    m.observe_idle(base.kv, 0, 0)
    assert m.device_busy._value.get() == pytest.approx(1.25 / 4)  # idle: busy stands still
    now[0] += 30.0
    m.observe_idle(base.kv, 0, 0)
    assert m.device_busy._value.get() == pytest.approx(0.0, abs=0.05)  # the window moved past the busy time
    assert "engine_device_busy_ratio" in m.names()
