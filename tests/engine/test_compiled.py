"""`model.compile`: when the forward is compiled, and what happens when it cannot be.

Exactness of the compiled forward against transformers' `generate` over a busy batch
(both KV policies, both kinds of steps, no graph compiled after the warm-up) is in
test_equivalence.py's compiled cases.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from schemas.params import SamplingParams
from worker.config import ConfigError, EngineConfig, ModelConfig
from worker.engine import Engine
from worker.engine import compile as compile_rules
from worker.model import compiled

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]


def engine(path, mode: str) -> Engine:
    return Engine.from_pretrained(str(path), EngineConfig(model=ModelConfig(dtype="float32", device="cpu",
                                                                            compile=mode)))


def test_the_setting_and_the_device_decide(monkeypatch):
    monkeypatch.setattr(compile_rules, "AUTO_DEVICES", frozenset({"cpu"}))  # the product's (tests/conftest.py)
    assert compile_rules.wanted("auto", "cpu", has_lora=False) == (True, "model.compile auto: on for cpu")
    assert compile_rules.wanted("auto", "cuda", has_lora=False)[0] is False
    assert compile_rules.wanted("on", "cuda", has_lora=False) == (True, "model.compile is on")
    assert compile_rules.wanted("off", "cpu", has_lora=False) == (False, "model.compile is off")
    on, why = compile_rules.wanted("on", "cpu", has_lora=True)
    assert not on and "LoRA" in why


def test_an_unknown_setting_names_the_field_and_the_values():
    with pytest.raises(ConfigError, match=r"model.compile must be one of \['auto', 'off', 'on'\], got 'fast'"):
        ModelConfig(compile="fast")


def test_a_forward_that_does_not_compile_stays_eager_with_the_reason(llama_path, monkeypatch, caplog):
    def broken(model):
        def forward(**kw):
            raise RuntimeError("inductor: no kernel for this op")
        return forward

    monkeypatch.setattr(compiled, "CompiledForward", broken)
    eng = engine(llama_path, "on")
    report = eng.compile_report
    assert not report.compiled and not eng.runner.compiled
    assert report.reason == "compiling failed: RuntimeError: inductor: no kernel for this op"
    assert "the forward stays eager: compiling failed: RuntimeError" in caplog.text
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in engine(llama_path, "off").generate(PROMPTS, GREEDY)]


def test_a_compiled_forward_that_changes_the_tokens_stays_eager(llama_path, monkeypatch):
    def wrong(model):
        def forward(**kw):
            out = model(**kw)
            out.logits = torch.flip(out.logits, dims=[-1])  # another argmax
            return out
        return forward

    monkeypatch.setattr(compiled, "CompiledForward", wrong)
    report = engine(llama_path, "on").compile_report
    assert report == compile_rules.CompileReport(False, "compiled greedy ids differ from eager ones")


def test_the_compiled_forward_reports_its_graph_and_goes_eager_if_it_fails_later(llama_path, caplog):
    eng = engine(llama_path, "on")
    report = eng.compile_report
    assert report.compiled and eng.runner.compiled and report.graphs == 1 and report.seconds > 0
    assert report.describe().startswith("compiled (1 graphs in ")
    assert eng.runner.forward_fn.warm  # guards skipped from now on
    eager = [o.token_ids for o in engine(llama_path, "off").generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == eager

    def fails(**kw):  # what a call needing another graph does with the guards skipped
        raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance")

    eng.runner.forward_fn._fn = fails
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == eager  # the failed step ran again, eagerly
    assert not eng.runner.compiled
    assert "the compiled forward failed (RuntimeError: Recompilation triggered" in caplog.text


def test_inductors_cache_is_ours_unless_set(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_rules.inductor_cache_dir() == tmp_path / "inflight" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    assert compile_rules.inductor_cache_dir() == tmp_path / "theirs"


def test_the_compile_bench_times_both_forwards_side_by_side(llama_path, tmp_path):
    from tools.bench import compile as bench

    assert bench.main(["--model", str(llama_path), "--running", "4", "--rounds", "2", "--iterations", "2",
                       "--skip-start-up", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "bench_compile.json").read_text())
    assert r["greedy_ids_identical"] and r["compiled_forward"].startswith("compiled (1 graphs")
    assert len(r["decode_step_ms"]["eager"]) == len(r["decode_step_ms"]["compiled"]) == 2
    ratios = [e / c for e, c in zip(r["decode_step_ms"]["eager"], r["decode_step_ms"]["compiled"])]
    assert r["decode_speedup_per_round"] == pytest.approx(ratios)
    assert r["decode_speedup"] == pytest.approx(statistics.median(ratios))


def test_latent_attention_compiles_and_keeps_its_tokens():
    """MLA's attention output is an einsum's (strided): the op hands it on contiguous, as
    its fake implementation promises, else Inductor's stride assertion sent DeepSeek-V2/V3
    and the other latent models back to eager (`tools.tiny_archs --all --compile`)."""
    from tests.conftest import arch_checkpoint

    path = arch_checkpoint("DeepSeek-V3")
    eng = engine(path, "on")
    assert eng.compile_report.compiled, eng.compile_report
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in engine(path, "off").generate(PROMPTS, GREEDY)]
