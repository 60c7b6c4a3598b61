"""Speculative decoding with a draft model (`speculative.method: draft`, worker/engine/draft.py)
through the real engine (tiny random-init Llama, fp32, CPU).

The checkpoint as its own draft must have every guess kept: its draft KV cache then holds
exactly what the model's holds, so a guess lost to stale draft KV (a preemption, a
prefix-cache hit, a chunked prefill, rejected guesses left in place) shows as a rejection.
A noisy copy of the checkpoint (tests/conftest.py `draft_checkpoint`) is right often and
wrong often: the tokens stay the model's, greedy and seeded, constrained or not. The
greedy equality with transformers' `generate` for Llama / Qwen2 / GPT-2 is in
test_equivalence.py (its `-draft` cases)."""

from __future__ import annotations

import json
import random

import pytest

from schemas.params import JsonSchemaOutput, SamplingParams
from tests.conftest import draft_checkpoint
from worker.config import ConfigError, EngineConfig, ModelConfig, ServingTuning, SpeculativeConfig
from worker.engine import Engine


def make_engine(path, draft=None, *, kv_tokens: int = 4096, batched: int = 256, k: int = 3) -> Engine:
    spec = SpeculativeConfig(method="draft" if draft else "off", draft_model=str(draft) if draft else None, min_speedup=None,
                             num_speculative_tokens=k, disable_by_batch_size=None, min_accepted_tokens=0.0)
    cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu"),
                       serving_tuning=ServingTuning(max_total_tokens=kv_tokens, max_batched_tokens=batched,
                                                    max_running_requests=8, speculative=spec))
    return Engine.from_pretrained(str(path), cfg)


@pytest.fixture(scope="module")
def engines(llama_path) -> dict[str, Engine]:
    return {"off": make_engine(llama_path), "noisy": make_engine(llama_path, draft_checkpoint("llama"))}


def workload(seed: int = 7, n: int = 12):
    """Prompts of 1-200 tokens, some sharing a 48-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(48)]
    prompts = []
    for i in range(n):
        prompt = [rng.randrange(1, 500) for _ in range(rng.choice([1, 5, 33, 90, 200]))]
        if i % 3 == 0:
            prompt = shared + prompt
        prompts.append(prompt)
    return prompts, [SamplingParams(temperature=0, max_tokens=rng.choice([2, 17, 40, 120]), ignore_eos=True)
                     for _ in prompts]


def test_the_model_as_its_own_draft_has_every_guess_kept(llama_path, engines):
    """Chunked prefill (32-token steps), preemption (400 KV tokens for 8 running), prefix
    hits: the ids are plain decoding's and the draft cache never goes stale."""
    prompts, params = workload()
    truth = [o.token_ids for o in engines["off"].generate(prompts, params)]
    engine = make_engine(llama_path, llama_path, kv_tokens=400, batched=32)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == truth
    stats = engine.scheduler.speculation.stats
    assert engine.scheduler.num_preemptions_total > 0, "the workload must preempt"
    assert stats.num_draft_tokens > 100
    # equal weights, other batch shapes: a near tie may flip an argmax, stale KV would flip many
    assert stats.num_accepted_tokens >= 0.98 * stats.num_draft_tokens, stats
    assert engine.core.drafter.num_failures == 0  # a failed fill costs guesses only: it would pass unseen
    assert engine.kv_stats().used_blocks == 0


def test_a_noisy_draft_keeps_greedy_and_seeded_ids(engines):
    prompts, greedy = workload(seed=3, n=6)
    sampled = [SamplingParams(temperature=0.9, top_k=40, seed=20 + i, repetition_penalty=1.2, max_tokens=30,
                              ignore_eos=True, logprobs=1) for i in range(len(prompts))]
    for params in (greedy, sampled):
        truth = engines["off"].generate(prompts, params)
        stats = engines["noisy"].scheduler.speculation.stats
        kept, guessed = stats.num_accepted_tokens, stats.num_draft_tokens
        together = engines["noisy"].generate(prompts, params)
        alone = [engines["noisy"].generate([p], [sp])[0] for p, sp in zip(prompts, params)]
        for a, b, c in zip(truth, together, alone):
            assert a.token_ids == b.token_ids == c.token_ids
            for x, y in zip(a.logprobs or [], b.logprobs or []):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
        kept, guessed = stats.num_accepted_tokens - kept, stats.num_draft_tokens - guessed
        assert 0 < kept < guessed, (kept, guessed)  # guesses kept and rejected


def test_constrained_requests_draft_within_their_grammar(engines):
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
              "required": ["name"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=60, temperature=t, seed=5, structured=JsonSchemaOutput(schema=schema))
              for t in (0.0, 1.0)]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    truth = [o.token_ids for o in engines["off"].generate(prompts, params)]
    outs = engines["noisy"].generate(prompts, params)
    assert [o.token_ids for o in outs] == truth
    for o in outs:
        jsonschema.validate(json.loads(o.text), schema)


def test_a_cancelled_speculating_request_frees_its_blocks_at_the_next_step(engines):
    engine = engines["noisy"]
    engine.add_request("c", prompt_token_ids=list(range(1, 60)), params=SamplingParams(max_tokens=200, ignore_eos=True,
                                                                                       temperature=0))
    drafts = engine.scheduler.speculation.stats.num_drafts
    for _ in range(8):
        engine.step()
    assert engine.scheduler.speculation.stats.num_drafts > drafts and engine.kv_stats().used_blocks > 0
    engine.abort("c")
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == "c"] == ["cancelled"]
    assert engine.kv_stats().used_blocks == 0


def test_a_failing_draft_model_costs_the_guesses_not_the_requests(llama_path, engines, caplog):
    prompts, params = workload(seed=5, n=4)
    truth = [o.token_ids for o in engines["off"].generate(prompts, params)]
    engine = make_engine(llama_path, draft_checkpoint("llama"))
    calls = []

    def broken(rows, steps, step):
        calls.append(step)
        raise RuntimeError("draft device lost")

    engine.core.drafter.runner.greedy_steps = broken  # the draft model's forwards
    stats = []
    real_step = engine.core.step

    def step():
        out = real_step()
        stats.append(engine.core.last_step_stats)
        return out

    engine.core.step = step
    outs = engine.generate(prompts, params)
    # the guesses taken back leave the step's counts whole (no negative prefill: metrics counters)
    assert all(s.num_prefill_tokens >= 0 and s.num_decode_tokens >= 0 for s in stats)
    assert [o.token_ids for o in outs] == truth and all(o.finish_reason == "length" for o in outs)
    assert len(calls) > 5 and engine.core.drafter.num_failures == len(calls)
    assert engine.scheduler.speculation.stats.num_draft_tokens == 0  # every step decoded plainly
    logged = sum("draft model failed" in r.getMessage() for r in caplog.records)
    assert logged == 1 + (len(calls) - 1) // 100  # the first, then every 100th


def test_no_draft_past_the_draft_models_context(llama_path, engines):
    prompts, params = [[5, 6, 7] * 10], [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    truth = engines["off"].generate(prompts, params)[0].token_ids
    engine = make_engine(llama_path, draft_checkpoint("llama"))
    engine.core.drafter.max_model_len = 45  # the prompt's 30 tokens + up to 12 output + 3 guesses
    assert engine.generate(prompts, params)[0].token_ids == truth
    stats = engine.scheduler.speculation.stats
    assert 0 < stats.num_drafts <= 12


def test_config_errors_name_the_field(llama_path, tmp_path):
    with pytest.raises(ConfigError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ConfigError, match="draft_model"):
        SpeculativeConfig(method="ngram", draft_model=str(llama_path))
    with pytest.raises(ConfigError, match="speculative.draft_model .*no config.json"):
        make_engine(llama_path, tmp_path / "nothing-here")
    from transformers import AutoTokenizer

    from tools.make_draft import copy_tokenizer

    other = tmp_path / "other-tokenizer"
    other.mkdir()
    for f in draft_checkpoint("llama").iterdir():
        if f.suffix in (".json", ".safetensors") and f.name != "tokenizer.json":
            (other / f.name).write_bytes(f.read_bytes())
    copy_tokenizer(draft_checkpoint("llama"), other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<not-in-the-model>"])
    tok.save_pretrained(other)
    with pytest.raises(ConfigError, match="tokenizer is not the model's"):
        make_engine(llama_path, other)


def test_inflight_check_loads_the_draft_model(llama_path, tmp_path):
    from worker.cli.model_checks import model_checks
    from worker.config import WorkerConfig

    def checks(draft) -> dict:
        spec = SpeculativeConfig(method="draft", draft_model=str(draft))
        cfg = WorkerConfig(model=ModelConfig(path=str(llama_path), dtype="float32", device="cpu"),
                           serving_tuning=ServingTuning(max_total_tokens=1024, speculative=spec))
        return {c.name: c for c in model_checks(cfg)}

    good = checks(draft_checkpoint("llama"))["draft model"]
    assert good.status == "pass" and good.setting == "serving_tuning.speculative.draft_model", good
    bad = checks(tmp_path / "missing")["draft model"]
    assert bad.status == "fail" and "no config.json" in bad.detail, bad


def test_the_draft_models_guesses_replay_from_decode_graphs(llama_path, engines, monkeypatch):
    """With decode graphs (emulated on the CPU: worker.model.graphs), the draft model's
    one-token guesses replay its graphs too, and they are the ones its forward gives: the
    model as its own draft still keeps every guess."""
    from worker.engine import compile as compile_rules

    monkeypatch.setattr(compile_rules, "GRAPH_REPLAY", {"cpu": "emulated"})
    prompts, params = workload(seed=9, n=4)
    truth = [o.token_ids for o in engines["off"].generate(prompts, params)]
    engine = make_engine(llama_path, llama_path)
    assert engine.compile_report.draft.startswith("eager, decode graphs for batches of 1-"), engine.compile_report
    graphs = engine.core.drafter.runner.graphs
    replayed = []
    real_run = graphs.run

    def count(input_ids, position_ids, md):
        replayed.append(input_ids.shape[0])
        return real_run(input_ids, position_ids, md)

    graphs.run = count
    assert [o.token_ids for o in engine.generate(prompts, params)] == truth
    stats = engine.scheduler.speculation.stats
    assert replayed and stats.num_draft_tokens > 50
    assert stats.num_accepted_tokens >= 0.98 * stats.num_draft_tokens, stats
    assert engine.core.drafter.num_failures == 0
