"""The copy model (`tools/make_copy_model.py`, the copy-heavy benchmark's checkpoint): it
quotes its prompt under transformers, the engine serves it with the same greedy ids, and
n-gram speculation keeps nearly every guess on it, so a copy-heavy workload runs in a
fraction of the steps."""

from __future__ import annotations

import random

import pytest
import torch

from schemas.params import SamplingParams
from tools.make_copy_model import make_copy_model
from worker.config import EngineConfig, ModelConfig, ServingTuning, SpeculativeConfig
from worker.engine import Engine


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory):
    return make_copy_model(tmp_path_factory.mktemp("copy-model"))


def quoting_prompts(n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, the tokens that quote it on): a passage of distinct tokens (no trigram
    twice, so one way to quote it), a separator, and the passage's first 6 tokens."""
    out = []
    for seed in range(n):
        passage = random.Random(seed).sample(range(1, 2048), 120)
        out.append((passage + [10, 10, 11] + passage[:6], passage[6:]))
    return out


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def test_the_copy_model_quotes_its_prompt_in_transformers(copy_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(copy_model), dtype=torch.float32)
    prompt, quote = quoting_prompts(1)[0]
    got = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert got == quote[:40]


@pytest.mark.parametrize("method", ["off", "ngram"])
def test_the_engine_quotes_as_transformers_does_and_ngram_keeps_the_guesses(copy_model, method):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, disable_by_batch_size=None,
                             min_accepted_tokens=0.0, min_speedup=None)
    engine = Engine.from_pretrained(str(copy_model), EngineConfig(
        model=ModelConfig(device="cpu", compile="off"),
        serving_tuning=ServingTuning(max_running_requests=4, max_total_tokens=4096, speculative=spec)))
    cases = quoting_prompts(3)
    out = generate(engine, [p for p, _ in cases], 48)
    assert [out[f"r{i}"] for i in range(3)] == [q[:48] for _, q in cases]
    if method == "ngram":
        stats = engine.scheduler.speculation.stats
        assert stats.num_drafts > 0, stats
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens, stats
        assert 1 + stats.num_accepted_tokens / stats.num_drafts >= 4.0, stats  # of at most 5 a step at k = 4
