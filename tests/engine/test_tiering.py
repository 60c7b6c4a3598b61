"""Prompt-length tiering on the tiny real model (issue 28's acceptance): one engine, a
steady open-loop stream of 16-token prompts with long prompts among them; under the
long-prefill cap the short prompts' TTFT p99 stays within 2x of the same stream without
long prompts. The stream and the figures are tools/bench/tiering.py's (its README row)."""

from __future__ import annotations

import pytest

from tools.bench.tiering import compare
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine


def _make(llama_path):
    def make(**over):
        tuning = ServingTuning(max_batched_tokens=2048, max_running_requests=64, **over)
        return Engine.from_pretrained(str(llama_path), EngineConfig(
            model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=tuning))
    return make


@pytest.mark.timing
def test_short_ttft_p99_under_the_long_prefill_cap_is_within_2x_of_short_prompts_alone(llama_path, one_torch_thread):
    # one torch thread: as a worker's engine with a neighbour on the cores (its thread budget)
    # cap 16 tokens a step. Time is the engine thread's CPU time (the stream's cpu clock): the CI box's
    # steal made the wall-clock p99 of the short-only stream alone swing 26-185 ms from one 3-s round to
    # the next (2026-12-04), so no wall-clock ratio of two streams meant anything there. The ratio is
    # paired: each round runs both streams back to back and divides the two p99s; the median of 7 rounds
    # is asserted: on the cpu clock 1.58x here, 1.66x with two busy loops on both cores (wall clock,
    # quiet: 1.13-1.56x in five runs). The p99 pooled over the rounds on the wall clock, asserted before,
    # failed 6 times after the suite's other tests (2.01-2.58x, 8.23x, then 2.07x as a paired median)
    # and never alone. The long prompts queued when the last short one finishes are aborted (their
    # backlog took ~10 s of a 17 s round and no short prompt sees it).
    mixes = compare(_make(llama_path), duration_s=3.0, interval_s=0.004, long_every=20, long_len=900,
                    threshold=128, cap=16, repeats=7, only=("short_only", "long_mix_cap"), drain_long=False,
                    clock="cpu")
    capped = mixes["long_mix_cap"]
    summary = {k: {"p99_ms": round(v["p99_s"] * 1e3, 2), "pooled_ratio": round(v["p99_vs_short_only"], 2),
                   "round_p99_ms": [round(x * 1e3, 1) for x in v["round_p99_s"]],
                   "round_ratios": [round(x, 2) for x in v["round_p99_vs_short_only"]]} for k, v in mixes.items()}
    assert capped["num_long"] > 0 and capped["num_short"] > 1000, summary
    assert capped["median_round_p99_vs_short_only"] <= 2.0, summary
