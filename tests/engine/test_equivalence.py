"""Continuous batching does not change model output (the correctness bar: exactly the tokens of the request run alone).

fp32, CPU, greedy: every request inside a busy, changing batch — chunked prefill,
preemption by recompute, prefix-cache hits, three tenants under fair share (weights,
a running quota, Yields) — yields exactly the token ids of transformers' own
`generate` for that request alone. With the forward compiled (`model.compile: on`,
both KV policies and both kinds of steps between the cases) too, and its warm-up
built every graph the workload needs: serving it compiles nothing more. And with the
decode steps replayed from graphs (`model.cuda_graphs`, emulated on the CPU), eager and
compiled, padded to the graph sizes. And with speculative decoding (prompt lookup, eager
and compiled; suffix decoding; a draft model: a noisy copy of the checkpoint), its
guesses both kept and rejected. And whatever `model.cpu_linear: auto` times as fastest
on this box, with the fixed rule (`inflight`: the small-batch kernel, oneDNN's packed
weights above), and with every linear layer held only in oneDNN's packed layout
(`worker.model.small_batch`; a model this small keeps the plain one too otherwise),
eager and compiled.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from schemas.params import SamplingParams
from tests.conftest import draft_checkpoint
from worker.config import EngineConfig, ModelConfig, ServingTuning, SpeculativeConfig, TenantPolicy
from worker.engine import Engine
from worker.engine import compile as compile_rules
from worker.model import small_batch


def reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=0)
    return out[0, len(prompt) :].tolist()


@functools.cache
def references(path: str, seed: int) -> dict[str, list[int]]:
    """transformers' greedy ids of each request of `staggered_workload(seed)` run alone,
    made once per checkpoint: the six cases of an architecture share them (its file's tests
    run in one process, pytest-xdist's `--dist loadfile`)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return {rid: reference(hf, prompt, max_tokens) for rid, prompt, max_tokens, _ in staggered_workload(seed)}


def staggered_workload(seed: int, n: int = 24, vocab: int = 512):
    rng = random.Random(seed)
    shared = [rng.randrange(1, vocab) for _ in range(40)]  # some requests share a prefix (prefix cache)
    reqs = []
    for i in range(n):
        plen = rng.choice([1, 2, 15, 16, 17, 33, rng.randrange(1, 301), rng.randrange(100, 301)])
        prompt = [rng.randrange(1, vocab) for _ in range(plen)]
        if i % 5 == 0 and plen > 40:
            prompt[:40] = shared
        max_tokens = rng.choice([1, 2, 17, rng.randrange(1, 201), 200])
        reqs.append((f"r{i}", prompt, max_tokens, rng.randrange(0, 40)))  # (id, prompt, max_tokens, add at step)
    return reqs


SEED = 1234

CASES = [  # (kv_policy, async_scheduling, model.compile, decode graphs, speculative decoding's method,
    #          float32 linear layers: `model.cpu_linear` auto or inflight, or packed = inflight held packed only)
    ("optimistic", False, "off", False, "off", "auto"), ("optimistic", True, "off", False, "off", "auto"),
    ("reserve", False, "off", True, "off", "auto"), ("reserve", True, "off", False, "off", "inflight"),
    ("optimistic", True, "on", True, "off", "auto"), ("reserve", False, "on", False, "off", "inflight"),
    ("optimistic", False, "off", False, "ngram", "auto"), ("reserve", False, "on", False, "ngram", "auto"),
    ("optimistic", False, "off", False, "suffix", "auto"), ("optimistic", False, "off", False, "draft", "auto"),
    ("optimistic", True, "off", False, "off", "packed"), ("reserve", False, "on", False, "off", "packed"),
    ("optimistic", False, "on", False, "draft", "auto"),
]


@pytest.mark.parametrize(("kv_policy", "async_scheduling", "compile_mode", "graphs", "speculative", "linear"),
                         CASES, ids=[f"{p}-{'async' if a else 'sequential'}{'-compiled' if c == 'on' else ''}"
                                     f"{'-graphs' if g else ''}{'' if n == 'off' else '-' + n}"
                                     f"{'' if k == 'auto' else '-' + k}" for p, a, c, g, n, k in CASES])
def test_greedy_equals_transformers_generate(any_arch_path, kv_policy, async_scheduling, compile_mode, graphs,
                                             speculative, linear, monkeypatch):
    if linear == "packed":
        monkeypatch.setattr(small_batch, "PLAIN_COPY_BYTES", 0)
    if graphs:  # decode steps replay graphs (emulated here: worker.model.graphs), padded to their sizes
        monkeypatch.setattr(compile_rules, "GRAPH_REPLAY", {"cpu": "emulated"})
    cfg = EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu", compile=compile_mode,
                          cpu_linear="auto" if linear == "auto" else "inflight"),
        serving_tuning=ServingTuning(
            max_total_tokens=1024,  # 64 blocks: far less than 24 x (prompt + output) -> preemption
            max_batched_tokens=64,  # prompts up to 300 tokens -> multi-chunk prefill
            max_running_requests=8,
            max_output_tokens=200,
            max_input_tokens=300,
            kv_policy=kv_policy,
            tenants={"t0": TenantPolicy(weight=3), "t1": TenantPolicy(max_running_requests=2)},
            async_scheduling=async_scheduling,
            # speculation for every request (the random models' greedy text repeats itself: drafts hit and miss)
            speculative=SpeculativeConfig(method=speculative, num_speculative_tokens=3, min_speedup=None,
                                          prompt_lookup_min=1, disable_by_batch_size=None, min_accepted_tokens=0.0,
                                          draft_model=str(draft_checkpoint(any_arch_path.name.split("-")[1]))
                                          if speculative == "draft" else None),
        ),
    )
    engine = Engine.from_pretrained(str(any_arch_path), cfg)
    placeholders = [m for m in engine.runner.model.modules()
                    if isinstance(m, small_batch.SmallBatchLinear) and m.weight.shape[-1] == 0]
    assert bool(placeholders) == (linear == "packed" and small_batch.packed_bytes(engine.runner.model) > 0)
    if linear == "inflight" and torch.backends.mkldnn.is_available():  # every layer on the fixed rule's paths
        assert all(type(m) is not torch.nn.Linear for m in engine.runner.model.modules()), "a layer left as it was"
    assert engine.compile_report.compiled == (compile_mode == "on"), engine.compile_report
    assert bool(engine.compile_report.cuda_graph_sizes) == graphs, engine.compile_report
    replayed = []
    if graphs:
        real_run = engine.runner.graphs.run

        def count(input_ids, position_ids, md):
            replayed.append(input_ids.shape[0])
            return real_run(input_ids, position_ids, md)

        engine.runner.graphs.run = count
    graphs_after_warm_up = counters["stats"]["unique_graphs"]
    chunked = []
    real_build = engine.runner.build_metadata  # every forward packs its step here (sequential or launched)

    def spy(sched):
        chunked.extend(s.request_id for s in sched.scheduled if s.start_pos > 0 and s.num_tokens > 1)
        return real_build(sched)

    engine.runner.build_metadata = spy
    work = staggered_workload(seed=SEED)
    tenant = {rid: f"t{i % 3}" for i, (rid, *_) in enumerate(work)}
    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in work}
    finals = {}
    step = 0
    while len(finals) < len(work):
        for rid, prompt, max_tokens, at in work:
            if at == step:
                engine.add_request(rid, prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=max_tokens),
                                   tenant=tenant[rid])
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        engine.check_invariants()
        step += 1
        assert step < 20_000

    if kv_policy == "optimistic":
        assert engine.scheduler.num_preemptions_total > 0, "workload must force preemption"
    else:
        assert engine.scheduler.num_preemptions_total == 0
    assert chunked, "workload must force multi-chunk prefill"
    assert engine.kv_stats().used_blocks == 0
    assert counters["stats"]["unique_graphs"] == graphs_after_warm_up, "the workload compiled a graph"
    # every step ran on the compiled forward (a step it could not serve would have gone eager)
    assert engine.runner.compiled == (compile_mode == "on") and engine.runner.compile_error is None
    if graphs:  # decode steps of several batch sizes replayed, some padded
        assert len(set(replayed)) >= 4 and {3, 5, 6, 7} & set(replayed), sorted(set(replayed))
    if speculative != "off":  # drafts verified, some guesses kept and some rejected (both paths ran)
        stats = engine.scheduler.speculation.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    if speculative == "draft":  # every fill guessed (a failed one costs its guesses only: it would pass unseen)
        assert engine.core.drafter.num_failures == 0
        assert engine.compile_report.draft == ("compiled" if compile_mode == "on" else ""), engine.compile_report

    refs = references(str(any_arch_path), SEED)
    mismatches = []
    for rid, prompt, max_tokens, _ in work:
        ref = refs[rid]
        if tokens[rid] != ref:
            mismatches.append((rid, len(prompt), max_tokens, ref[:8], tokens[rid][:8]))
        assert finals[rid].usage.completion_tokens == len(tokens[rid])
        assert finals[rid].usage.prompt_tokens == len(prompt)
    assert not mismatches, mismatches
