"""Multi-LoRA (issue 30) on the tiny real models, fp32 on the CPU: every request of a
batch that mixes three adapters of different ranks and the base model yields exactly
the greedy ids of transformers' `generate` on the base model with that adapter merged
by `peft` (`merge_and_unload`), or on the base model alone, across chunked prefill and
preemption by recompute; adapters load off the step path under LRU eviction."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from schemas.params import SamplingParams
from tests.conftest import tiny_checkpoint
from tools.make_lora import make_adapter
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine, RejectReason, RequestRejected

# (name, rank, extra LoraConfig): different ranks, targets, scalings
# (rank, make_adapter arguments): different ranks, targets, scalings. Random A and B of
# std 0.1 change nearly every greedy continuation of the tiny models while keeping their
# logits well conditioned (at 0.3, transformers' own generate and its full forward
# disagreed on a near tie, so no reference is exact there).
ADAPTERS = {
    "a4": (4, dict(targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))),
    "b8": (8, dict(targets=("q_proj", "v_proj"), std=0.15)),
    "c16": (16, dict(targets=("q_proj", "o_proj", "up_proj", "down_proj"), use_rslora=True,
                     alpha_pattern={"o_proj": 4.0})),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base_and_loras(request, tmp_path_factory) -> tuple[Path, Path]:
    base = tiny_checkpoint(request.param)
    root = tmp_path_factory.mktemp(f"loras-{request.param}")
    for i, (name, (rank, kw)) in enumerate(ADAPTERS.items()):
        make_adapter(base, root / name, rank, seed=i + 1, **kw)
    return base, root


def references(base: Path, root: Path, work: list[tuple[str, list[int], int, str | None]]) -> dict[str, list[int]]:
    """Greedy ids of each request alone: transformers' generate on the base model, or
    on the base model with the request's adapter merged by peft."""
    from peft import PeftModel

    refs = {}
    for adapter in {a for *_, a in work}:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(root / adapter)).merge_and_unload()
        for rid, prompt, max_tokens, a in work:
            if a == adapter:
                out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                     min_new_tokens=max_tokens)
                refs[rid] = out[0, len(prompt):].tolist()
    return refs


def engine(base: Path, root: Path | None, max_loras: int = 4, compile: str = "auto", precompile: bool = True,
           **tuning) -> Engine:
    t = dict(max_total_tokens=4096, max_batched_tokens=256, max_running_requests=8, enable_prefix_caching=True)
    t.update(tuning)
    return Engine.from_pretrained(str(base), EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu", lora_dir=str(root) if root else None, max_loras=max_loras,
                          compile=compile, precompile=precompile),
        serving_tuning=ServingTuning(**t)))


def workload(seed: int, n: int, adapters: list[str | None]) -> list[tuple[str, list[int], int, str | None]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(48)]  # the same prefix under every adapter
    work = []
    for i in range(n):
        prompt = shared + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 90))]
        work.append((f"r{i}", prompt, rng.choice([5, 17, 40]), adapters[i % len(adapters)]))
    return work


def run(eng: Engine, work, step_s: list[float] | None = None) -> dict[str, list[int]]:
    sp = {m: SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in {w[2] for w in work}}
    for rid, prompt, max_tokens, adapter in work:
        eng.add_request(rid, prompt_token_ids=prompt, params=sp[max_tokens], adapter=adapter)
    got: dict[str, list[int]] = {rid: [] for rid, *_ in work}
    while eng.has_unfinished():
        t0 = time.perf_counter()
        outs = eng.step()
        if step_s is not None:
            step_s.append(time.perf_counter() - t0)
        for o in outs:
            assert o.finish_reason in (None, "length"), (o.request_id, o.finish_reason, o.error_message)
            got[o.request_id].extend(o.new_token_ids)
    return got


@pytest.mark.parametrize(("async_scheduling", "speculative"),
                         [(False, "off"), (True, "off"), (False, "ngram"), (False, "draft")],
                         ids=["sequential", "async", "sequential-ngram", "sequential-draft"])
def test_a_mixed_batch_equals_peft_merged_generate(base_and_loras, async_scheduling, speculative):
    """16 requests cycling base / a4 / b8 / c16 over one shared 48-token prefix, 32-token
    steps (chunked prefill) and 384 tokens of KV (preemption): each equals its own
    reference; the base model's requests equal their solo run. With speculative decoding
    (prompt lookup; a draft model, which drafts without adapters) each request's guesses
    are verified with its own adapter."""
    from tests.conftest import draft_checkpoint
    from worker.config import SpeculativeConfig

    base, root = base_and_loras
    work = workload(1, 16, [None, "a4", "b8", "c16"])
    spec = SpeculativeConfig(method=speculative, num_speculative_tokens=3, prompt_lookup_min=1, min_speedup=None,
                             disable_by_batch_size=None, min_accepted_tokens=0.0,
                             draft_model=str(draft_checkpoint(base.name.split("-")[1])) if speculative == "draft"
                             else None)
    # (a draft model's guesses differ from prompt lookup's: 320 tokens for it to preempt too)
    eng = engine(base, root, max_batched_tokens=32, max_total_tokens=320 if speculative == "draft" else 384,
                 async_scheduling=async_scheduling, speculative=spec)
    chunks = []
    real = eng.runner.build_metadata

    def spy(sched):
        chunks.extend(s.num_tokens for s in sched.scheduled[sched.num_decodes:])
        return real(sched)

    eng.runner.build_metadata = spy
    got = run(eng, work)
    refs = references(base, root, work)
    for rid, *_, adapter in work:
        assert got[rid] == refs[rid], (rid, adapter)
    assert eng.scheduler.num_preemptions_total > 0  # preemption happened
    assert max(chunks) == 32 and any(c < 32 for c in chunks)  # prompts were split into chunks
    if speculative != "off":  # guesses kept and rejected, under adapters
        stats = eng.scheduler.speculation.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    base_refs = references(base, root, [(rid, p, m, None) for rid, p, m, a in work if a is not None])
    assert sum(refs[rid] != ids for rid, ids in base_refs.items()) >= 10  # of 12: the adapters change the output


def test_a_plain_models_graph_never_serves_the_same_model_with_adapters(base_and_loras):
    """Dynamo keeps graphs per code object and a warm compiled forward skips their guards:
    the plain model compiled first in this process must not lend its graph (without the
    adapters' ops) to the same model with LoRA hooks (`worker.model.compiled._code_of`);
    an engine of the same plain model still reuses it."""
    base, root = base_and_loras
    plain = engine(base, None, compile="on", precompile=False)
    assert plain.compile_report.compiled
    assert engine(base, None, compile="on", precompile=False).compile_report.graphs == 0  # the same model: shared
    work = workload(2, 8, ["a4", None, "b8", "c16"])
    refs = references(base, root, work)
    eng = engine(base, root, compile="on", precompile=False, max_batched_tokens=32, max_total_tokens=384)
    assert eng.compile_report.compiled and eng.compile_report.graphs == 1, eng.compile_report  # a graph of its own
    got = run(eng, work)
    for rid, *_, adapter in work:
        assert got[rid] == refs[rid], (rid, adapter)


@pytest.mark.parametrize("precompile", [True, False], ids=["captured", "dynamo"])
def test_a_compiled_forward_serves_adapters_exactly(base_and_loras, precompile, tmp_path, monkeypatch):
    """A LoRA model compiles (the delta an opaque op, `worker.model.lora`): the mixed batch
    of the eager test, chunked prefill and preemption included, equals the references;
    a captured forward is keyed apart from the base model's (its hooks add ops), and a
    second engine loads it and serves the same ids without compiling again."""
    import torch._dynamo

    from worker.engine import compile as compile_rules
    from worker.model.compiled import artifact_key

    monkeypatch.setattr(compile_rules, "precompiled_dir", lambda: tmp_path / "precompiled")
    base, root = base_and_loras
    work = workload(1, 16, [None, "a4", "b8", "c16"])
    eng = engine(base, root, compile="on", precompile=precompile, max_batched_tokens=32, max_total_tokens=384)
    report = eng.compile_report
    assert report.compiled, report.describe()
    assert report.artifact == ("captured" if precompile else "")
    plain = engine(base, None, compile="off")
    assert artifact_key(eng.runner.model) != artifact_key(plain.runner.model)
    refs = references(base, root, work)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = run(eng, work)
    for rid, *_, adapter in work:
        assert got[rid] == refs[rid], (rid, adapter)
    assert eng.scheduler.num_preemptions_total > 0
    assert eng.runner.compiled and eng.runner.compile_error is None  # never fell back to eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before  # no graph built while serving
    if precompile:
        again = engine(base, root, compile="on", max_batched_tokens=32, max_total_tokens=384)
        assert again.compile_report.artifact == "loaded"
        got = run(again, workload(1, 16, [None, "a4", "b8", "c16"]))
        assert all(got[rid] == refs[rid] for rid, *_ in work)


def test_prefix_cache_is_salted_by_adapter(base_and_loras):
    base, root = base_and_loras
    eng = engine(base, root)
    prompt = list(range(1, 70))
    sp = SamplingParams(max_tokens=2, temperature=0)
    cached = {}
    for rid, adapter in (("first", "a4"), ("same", "a4"), ("other", "b8"), ("base", None)):
        eng.add_request(rid, prompt_token_ids=prompt, params=sp, adapter=adapter)
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    cached[rid] = o.usage.cached_prompt_tokens
    assert cached["same"] == 64 and cached["other"] == 0 and cached["base"] == 0, cached


@pytest.mark.timing
def test_lru_with_a_slow_loader_never_stalls_a_step(base_and_loras, monkeypatch, one_torch_thread):
    """max_loras 2, three adapters in use, each load slowed to 1 s: every request is
    right, loads and evictions are counted, and the engine keeps stepping while loads
    are under way (base requests decode meanwhile) with no step lasting a load.

    One torch thread (`one_torch_thread`), as a worker's engine on a small box has: with
    one per core, a core taken by anything else (a noisy neighbour, the host's steal) held
    every OpenMP barrier of a step, which then lasted as long as a load as if it had waited
    for it (worst step 1.0-1.35 s with two busy loops on the 2-core box; with one thread
    12 ms there, 6 ms quiet)."""
    import worker.model.lora as lora_mod

    base, root = base_and_loras
    real_read = lora_mod.read_adapter

    def slow_read(spec, dtype):
        time.sleep(1.0)
        return real_read(spec, dtype)

    monkeypatch.setattr(lora_mod, "read_adapter", slow_read)
    eng = engine(base, root, max_loras=2)
    work = workload(2, 12, ["a4", "b8", "c16", None])
    steps: list[tuple[float, bool, int]] = []  # (seconds, a load under way, tokens computed)
    stats = []
    real_step = eng.step

    def step():
        loading = eng.scheduler.loras.loading
        t0 = time.perf_counter()
        outs = real_step()
        s = eng.last_step_stats
        stats.append(s)
        steps.append((time.perf_counter() - t0, loading, s.num_prefill_tokens + s.num_decode_tokens if s else 0))
        return outs

    eng.step = step
    got = run(eng, work)
    refs = references(base, root, work)
    assert all(got[rid] == refs[rid] for rid, *_ in work)
    lora = [s.lora for s in stats if s is not None and s.lora is not None]
    loads = sum(s.loads for s in lora)
    assert loads >= 3 and sum(s.evictions for s in lora) >= 1, (loads, [s for s in lora if s.loads or s.evictions])
    assert max(s.resident for s in lora) <= 2
    assert sum(len(s.load_s) for s in lora) == loads and min(x for s in lora for x in s.load_s) >= 1.0
    worst = max(steps)
    assert worst[0] < 0.5, (worst, steps.index(worst), len(steps))  # a load takes 1 s: none was waited for
    assert sum(1 for _, loading, tokens in steps if loading and tokens) >= 10  # base requests decoded meanwhile


def test_max_loras_per_batch_caps_the_running_adapters_and_starves_none(base_and_loras):
    base, root = base_and_loras
    eng = engine(base, root, max_loras_per_batch=1)
    work = workload(3, 9, ["a4", "b8", "c16"])
    seen = []
    real = eng.runner.build_metadata

    def spy(sched):
        seen.append({s.lora_slot for s in sched.scheduled})
        return real(sched)

    eng.runner.build_metadata = spy
    got = run(eng, work)
    refs = references(base, root, work)
    assert all(got[rid] == refs[rid] for rid, *_ in work)
    assert all(len(s) == 1 for s in seen), seen  # one adapter per step, and every request finished


def test_unknown_and_invalid_adapters_are_rejected(base_and_loras, tmp_path):
    base, root = base_and_loras
    make_adapter(base, root / "big", 32)  # above max_lora_rank 16
    make_adapter(base, root / "dora", 4, use_dora=True)
    (root / "pickled").mkdir()
    (root / "pickled" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (root / "pickled" / "adapter_model.bin").write_bytes(b"not loaded")
    gpt2 = tiny_checkpoint("gpt2")
    make_adapter(gpt2, root / "gpt2", 4, targets=("c_attn",))  # GPT-2's Conv1D: fan_in_fan_out
    wider = make_adapter(base, root / "wider", 4)  # as if made for a base model of twice the width
    tensors = load_file(wider / "adapter_model.safetensors")
    save_file({k: torch.zeros(t.shape[0] * (k.endswith("lora_B.weight") + 1), t.shape[1] * (
        k.endswith("lora_A.weight") + 1)) for k, t in tensors.items()}, wider / "adapter_model.safetensors")
    eng = engine(base, root)
    verdicts = eng.input.adapters.scan()  # what the engine logs at start
    assert verdicts["a4"] is None and "max_lora_rank" in verdicts["big"] and "pickled" in verdicts
    sp = SamplingParams(max_tokens=2)
    cases = {"nope": RejectReason.UNKNOWN_ADAPTER, "../a4": RejectReason.UNKNOWN_ADAPTER,
             "big": RejectReason.INVALID_ADAPTER, "dora": RejectReason.INVALID_ADAPTER,
             "pickled": RejectReason.INVALID_ADAPTER, "gpt2": RejectReason.INVALID_ADAPTER,
             "wider": RejectReason.INVALID_ADAPTER}
    for name, reason in cases.items():
        with pytest.raises(RequestRejected) as e:
            eng.add_request(f"x-{name}", prompt_token_ids=[1, 2], params=sp, adapter=name)
        assert e.value.reason == reason, (name, e.value)
    assert "max_lora_rank" in _message(eng, "big") and "DoRA" in _message(eng, "dora")
    assert "pickle" in _message(eng, "pickled") and "fan_in_fan_out" in _message(eng, "gpt2")
    assert "another base model" in _message(eng, "wider")
    no_lora = engine(base, None)
    with pytest.raises(RequestRejected) as e:
        no_lora.add_request("y", prompt_token_ids=[1, 2], params=sp, adapter="a4")
    assert e.value.reason == RejectReason.UNKNOWN_ADAPTER and "lora_dir" in e.value.message


def _message(eng: Engine, name: str) -> str:
    try:
        eng.add_request(f"m-{name}", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=2), adapter=name)
    except RequestRejected as e:
        return e.message
    return ""


def test_an_adapter_that_fails_to_load_ends_its_requests_with_an_error(base_and_loras, tmp_path):
    base, root = base_and_loras
    lora_dir = tmp_path / "loras"
    make_adapter(base, lora_dir / "flaky", 4)
    eng = engine(base, lora_dir)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    eng.add_request("ok", prompt_token_ids=[1, 2, 3], params=sp)
    eng.add_request("bad", prompt_token_ids=[1, 2, 3], params=sp, adapter="flaky")  # checked: valid
    (lora_dir / "flaky" / "adapter_model.safetensors").write_bytes(b"\x00" * 16)  # then broken on disk
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    assert finals["ok"].finish_reason == "length"
    assert finals["bad"].finish_reason == "error" and finals["bad"].error_code == "adapter_load_failed"
    assert "flaky" in finals["bad"].error_message
