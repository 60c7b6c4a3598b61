"""The engine with the Triton back end forced (the interpreter on the CPU) still yields
exactly transformers' greedy tokens: decodes, chunked prefill, preemption, prefix hits."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas.params import SamplingParams
from tests.engine.test_equivalence import reference
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine
from worker.model.kernels import triton_attn


def test_greedy_equals_transformers_generate_with_triton(llama_path):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = EngineConfig(
        model=ModelConfig(dtype="float32", device=device, attention_backend="triton"),
        serving_tuning=ServingTuning(max_total_tokens=128, max_batched_tokens=24, max_running_requests=4,
                                     max_output_tokens=32, kv_block_size=16),
    )
    engine = Engine.from_pretrained(str(llama_path), cfg)
    assert engine.runner.backend is triton_attn
    rng = random.Random(7)
    shared = [rng.randrange(5, 500) for _ in range(32)]
    work = []
    for i, plen in enumerate((1, 16, 17, 45, 40, 9)):
        prompt = [rng.randrange(5, 500) for _ in range(plen)]
        if plen == 40:
            prompt[:32] = shared
        work.append((f"r{i}", prompt, rng.choice([1, 12, 20, 30])))
    work.append(("r-shared", shared + [3, 4, 5], 6))  # hits the two cached prefix blocks
    tokens = {rid: [] for rid, *_ in work}
    for rid, prompt, max_tokens in work:
        engine.add_request(rid, prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=max_tokens))
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        engine.check_invariants()
    assert engine.scheduler.num_preemptions_total > 0, "the KV budget must force preemption"
    model = AutoModelForCausalLM.from_pretrained(str(llama_path), dtype=torch.float32).eval()
    for rid, prompt, max_tokens in work:
        assert tokens[rid] == reference(model, prompt, max_tokens), rid


@pytest.mark.parametrize("family", ["Gemma 2", "GPT-OSS", "Mistral (sliding window)", "DeepSeek-V3"])
def test_layer_features_through_the_triton_engine(family):
    """Alternating 16-token windows, soft-capping, sinks, a window freeing KV blocks,
    the latent cache: the whole engine on the Triton kernels (interpreter on the
    CPU; the load check runs on them too), exact against transformers."""
    from tests.conftest import arch_checkpoint
    from tools.tiny_archs import verdict

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        pytest.skip("tools.tiny_archs runs the CPU engine; on CUDA the kernels are covered by tools/gpu_check.py")
    assert verdict(arch_checkpoint(family), max_tokens=8, backend="triton") == {"result": "exact"}
