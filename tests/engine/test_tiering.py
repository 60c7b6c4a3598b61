"""Prompt-length tiering on the tiny real model (issue 28's acceptance): one engine, a
steady open-loop stream of 16-token prompts with long prompts among them; under the
long-prefill cap the short prompts' TTFT p99 stays within 2x of the same stream without
long prompts. The stream and the figures are tools/bench/tiering.py's (its README row)."""

from __future__ import annotations

import pytest
import torch

from tools.bench.tiering import compare
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine


@pytest.mark.timing
def test_short_ttft_p99_under_the_long_prefill_cap_is_within_2x_of_short_prompts_alone(llama_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker's engine with a neighbour on the cores (its thread budget)

    def make(**over):
        tuning = ServingTuning(max_batched_tokens=2048, max_running_requests=64, **over)
        return Engine.from_pretrained(str(llama_path), EngineConfig(
            model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=tuning))

    try:
        # cap 16 tokens a step: 1.41x here (cap 32, tools.bench.tiering's default: 1.5-1.8x, 2.11x once in
        # CI with the mixes run one after the other; the rounds now interleave them)
        mixes = compare(make, duration_s=3.0, interval_s=0.004, long_every=20, long_len=900, threshold=128, cap=16,
                        repeats=4, only=("short_only", "long_mix_cap"))
    finally:
        torch.set_num_threads(threads)
    summary = {k: (round(v["p99_s"] * 1e3, 2), round(v["p99_vs_short_only"], 2)) for k, v in mixes.items()}
    assert mixes["long_mix_cap"]["num_long"] > 0 and mixes["long_mix_cap"]["num_short"] > 1000, summary
    assert mixes["long_mix_cap"]["p99_vs_short_only"] <= 2.0, summary
