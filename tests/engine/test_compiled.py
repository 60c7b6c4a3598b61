"""`model.compile`: when the forward is compiled, and what happens when it cannot be;
`model.precompile`: a forward captured ahead of time by one start and loaded by the next.

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
from worker.cli.checks import Check
from worker.config import ConfigError, EngineConfig, ModelConfig
from worker.engine import Engine
from worker.engine import compile as compile_rules
from worker.model import compiled

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]


needs_precompile = pytest.mark.skipif(not compiled.precompile_available("cpu"),
                                      reason="torch.compiler.precompile is torch >= 2.15")


def engine(path, mode: str, precompile: bool = True) -> Engine:
    return Engine.from_pretrained(str(path), EngineConfig(model=ModelConfig(dtype="float32", device="cpu",
                                                                            compile=mode, precompile=precompile)))


@pytest.fixture
def artifacts(tmp_path, monkeypatch):
    """Captured forwards go to a directory of this test's own."""
    monkeypatch.setattr(compile_rules, "precompiled_dir", lambda: tmp_path / "precompiled")
    return tmp_path / "precompiled"


def test_the_setting_and_the_device_decide(monkeypatch):
    monkeypatch.setattr(compile_rules, "AUTO_DEVICES", frozenset({"cpu"}))  # the product's (tests/conftest.py)
    assert compile_rules.wanted("auto", "cpu") == (True, "model.compile auto: on for cpu")
    assert compile_rules.wanted("auto", "cuda")[0] is False
    assert compile_rules.wanted("on", "cuda") == (True, "model.compile is on")
    assert compile_rules.wanted("off", "cpu") == (False, "model.compile is off")


def test_an_unknown_setting_names_the_field_and_the_values():
    with pytest.raises(ConfigError, match=r"model.compile must be one of \['auto', 'off', 'on'\], got 'fast'"):
        ModelConfig(compile="fast")


def test_a_forward_that_does_not_compile_stays_eager_with_the_reason(llama_path, monkeypatch, caplog):
    def broken(model):
        def forward(**kw):
            raise RuntimeError("inductor: no kernel for this op")
        return forward

    monkeypatch.setattr(compiled, "CompiledForward", broken)
    eng = engine(llama_path, "on", precompile=False)
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
    report = engine(llama_path, "on", precompile=False).compile_report
    assert report == compile_rules.CompileReport(False, "compiled greedy ids differ from eager ones")


def test_without_the_cxx_operators_the_forward_compiles_around_the_python_attention_op(llama_path, monkeypatch):
    """A box without a C++ compiler (and CUDA) trace `inflight::attention`, whose fake
    implementation gives the trace its shapes."""
    from worker.model.kernels import native

    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "LOADED", False)
    torch._dynamo.reset()
    eng = engine(llama_path, "on", precompile=False)
    assert eng.compile_report.compiled and eng.runner.native_layers is None, eng.compile_report
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in engine(llama_path, "off").generate(PROMPTS, GREEDY)]
    torch._dynamo.reset()  # the next engines trace with the C++ operator again


def test_the_compiled_forward_reports_its_graph_and_goes_eager_if_it_fails_later(llama_path, caplog):
    torch._dynamo.reset()  # the graph of an earlier engine of this model in this process would serve it
    eng = engine(llama_path, "on", precompile=False)
    report = eng.compile_report
    assert report.compiled and eng.runner.compiled and report.graphs == 1 and report.seconds > 0
    assert report.describe().startswith("compiled (1 graphs in ")
    assert eng.runner.forward_fn.warm  # guards skipped from now on
    again = engine(llama_path, "on", precompile=False)  # another engine of the model: the same graph serves
    assert again.compile_report.compiled and again.compile_report.graphs == 0, again.compile_report
    assert again.compile_report.describe().startswith("compiled (the graph of an earlier engine in this process")
    assert [o.token_ids for o in again.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in engine(llama_path, "off").generate(PROMPTS, GREEDY)]
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
    assert r["greedy_ids_identical"] and r["compiled_forward"].startswith("compiled (")
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


@needs_precompile
def test_a_captured_forward_is_loaded_by_the_next_start_without_a_trace(llama_path, artifacts):
    from torch._dynamo.utils import counters

    eager = [o.token_ids for o in engine(llama_path, "off").generate(PROMPTS, GREEDY)]
    first = engine(llama_path, "on")
    assert first.compile_report.artifact == "captured" and first.compile_report.graphs == 1, first.compile_report
    assert [o.token_ids for o in first.generate(PROMPTS, GREEDY)] == eager
    (key,) = [p.name for p in artifacts.iterdir()]
    assert sorted(p.name for p in (artifacts / key).iterdir()) == [compiled.CACHE, compiled.ARTIFACT]

    traced = counters["stats"]["unique_graphs"]
    second = engine(llama_path, "on")  # another engine in this process: the op's layer numbers are the same
    assert second.compile_report.artifact == "loaded", second.compile_report
    assert second.compile_report.describe().startswith("compiled (captured forward loaded; warm-up ")
    assert counters["stats"]["unique_graphs"] == traced  # Dynamo traced nothing
    assert [o.token_ids for o in second.generate(PROMPTS, GREEDY)] == eager
    assert second.runner.compiled and second.runner.compile_error is None


@needs_precompile
def test_an_artifact_that_does_not_load_is_captured_again(llama_path, artifacts, caplog):
    first = engine(llama_path, "on")
    (path,) = list(artifacts.iterdir())
    (path / compiled.ARTIFACT).write_text("this is not a captured forward\n")
    again = engine(llama_path, "on")
    assert again.compile_report.artifact == "captured", again.compile_report
    assert "a captured forward did not load" in caplog.text
    assert [o.token_ids for o in again.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in first.generate(PROMPTS, GREEDY)]


@needs_precompile
def test_a_forward_the_capture_refuses_is_built_by_torch_compile(llama_path, artifacts, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise torch.compiler.PrecompileError("precompile: fn reads a tensor it was not given")

    monkeypatch.setattr(torch.compiler.precompile, "capture", refuse)
    eng = engine(llama_path, "on")
    report = eng.compile_report
    assert report.compiled and report.artifact == "" and report.graphs <= 1, report  # 0: an earlier one's graph
    assert report.capture_fallback == "PrecompileError: precompile: fn reads a tensor it was not given"
    assert "could not be captured ahead of time" in caplog.text
    assert not any(artifacts.iterdir())  # nothing half-written left behind
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in engine(llama_path, "off").generate(PROMPTS, GREEDY)]


@needs_precompile
def test_a_captured_forward_that_fails_later_reruns_the_step_eagerly(llama_path, artifacts, caplog):
    eng = engine(llama_path, "on")
    eager = [o.token_ids for o in engine(llama_path, "off").generate(PROMPTS, GREEDY)]

    def fails(*args):  # what a call the artifact cannot serve does
        raise RuntimeError("Expected size 1 but got 3")

    eng.runner.forward_fn._run = fails
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == eager
    assert not eng.runner.compiled
    assert "the compiled forward failed (RuntimeError: Expected size 1" in caplog.text


def test_the_artifact_key_follows_the_models_structure_not_its_weights(llama_path):
    from tests.conftest import tiny_checkpoint

    def loaded(path):
        return engine(path, "off").runner.model

    a, b = loaded(llama_path), loaded(llama_path)
    assert compiled.artifact_key(a) == compiled.artifact_key(b)
    with torch.no_grad():
        next(b.parameters()).add_(1.0)  # other weights, same shapes: the same artifact serves them
    assert compiled.artifact_key(a) == compiled.artifact_key(b)
    assert compiled.artifact_key(a) != compiled.artifact_key(loaded(tiny_checkpoint("qwen2")))
    assert compiled.artifact_key(a) != compiled.artifact_key(b.to(torch.float64))


def test_two_attention_modules_with_one_layer_number_stay_eager(llama_path):
    eng = engine(llama_path, "off")
    layers = eng.runner.model.model.layers
    layers[1].self_attn.layer_idx = layers[0].self_attn.layer_idx
    with pytest.raises(ValueError, match="two attention modules have layer_idx 0"):
        eng.runner.compile()


def test_inflight_check_says_how_the_forward_will_run(llama_path, artifacts):
    from worker.cli.model_checks import compile_check
    from worker.config import WorkerConfig
    from worker.model.loader import load_model

    def check(**model):
        cfg = WorkerConfig(model=ModelConfig(path=str(llama_path), dtype="float32", device="cpu", **model))
        return compile_check(cfg, loaded)

    loaded = load_model(ModelConfig(path=str(llama_path), dtype="float32", device="cpu"))
    assert check(compile="off") == Check("compile", "info", "model.compile", "eager (model.compile is off)")
    no_capture = check(compile="on", precompile=False)
    assert no_capture.detail == ("model.compile is on; torch.compile traces the model at every start "
                                 "(model.precompile is off)")
    if not compiled.precompile_available("cpu"):
        return
    first = check(compile="on")
    assert first.setting == "model.precompile" and "the first start captures the forward" in first.detail
    eng = engine(llama_path, "on")  # captures it, under the key the check computed
    assert eng.compile_report.artifact == "captured"
    ready = check(compile="on")
    assert "a captured forward is ready, the start loads it" in ready.detail
    (path,) = list(artifacts.iterdir())
    assert str(path) in ready.detail


@needs_precompile
def test_the_artifact_is_bound_to_its_model_once(llama_path, artifacts):
    """Steps call the artifact's graph with the parameter list checked at load; another
    model is refused there; an artifact without those parts is called as it is."""
    from tests.conftest import tiny_checkpoint

    fwd = engine(llama_path, "on").runner.forward_fn
    model = fwd.model
    fwd.model = engine(tiny_checkpoint("qwen2"), "off").runner.model
    with pytest.raises(torch.compiler.PrecompileError, match="do not match the traced model"):
        fwd._bind(compiled._load(fwd.path))

    calls = []

    def entry_point(*args):
        calls.append(args)
        return "logits"

    fwd.model = model
    assert fwd._bind(entry_point)("ids", "positions", "keep") == "logits"
    assert calls == [(model, "ids", "positions", "keep")]


CAPTURE_SCRIPT = """
import sys
from worker.config import EngineConfig, ModelConfig
from worker.engine import Engine
from schemas.params import SamplingParams
e = Engine.from_pretrained(sys.argv[1], EngineConfig(model=ModelConfig(dtype="float32", device="cpu", compile="on")))
out = e.generate([[5, 6, 7, 8, 9, 10, 11], [12, 13]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
print(e.compile_report.artifact, [o.token_ids for o in out])
"""


@needs_precompile
def test_workers_starting_together_on_one_cache_each_capture_and_one_artifact_stays(llama_path, tmp_path):
    """Two processes capture the same forward into one (empty) cache at once, as workers
    on one machine sharing a cache volume do: both serve, the rename keeps one artifact
    whole, and the next start loads it."""
    import os
    import subprocess
    import sys

    # the captured forwards' cache empty; Inductor's kernels from the machine's cache, as
    # every start on it finds them (building them again in each process is not what this
    # test is about: 44 -> 39 CPU-s on the 2-core box; the capture itself still compiles)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(compile_rules.inductor_cache_dir())}
    cmd = [sys.executable, "-c", CAPTURE_SCRIPT, str(llama_path)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    lines = [out.strip().splitlines()[-1] for out, _ in outs]
    ids = {line.split(" ", 1)[1] for line in lines}
    assert len(ids) == 1 and all(line.split()[0] in ("captured", "loaded") for line in lines), lines
    entries = list((tmp_path / "inflight" / "precompiled").iterdir())
    assert len(entries) == 1 and sorted(p.name for p in entries[0].iterdir()) == [compiled.CACHE, compiled.ARTIFACT]
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == f"loaded {ids.pop()}", again.stderr[-2000:]
