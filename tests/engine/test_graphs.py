"""Decode graphs (`model.cuda_graphs`, worker.model.graphs): when they are captured, what
a replay reads, and what happens when a capture fails or its tokens differ.

The CUDA capture itself needs a GPU (tools/gpu_check.py compares graphs with eager
steps there); here the graphs replay emulated (`replay="emulated"`: the call is
remembered with the static buffers and re-run, so anything a step did not copy into
them is read stale, as a graph would). Exactness over a busy batch with preemption and
chunked prefill, eager and compiled, is in test_equivalence.py's `-graphs` cases.
"""

from __future__ import annotations

import pytest
import torch

from schemas.params import SamplingParams
from worker.config import ConfigError, EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine
from worker.engine import compile as compile_rules
from worker.model import graphs as graph_mod
from worker.model.graphs import DecodeGraphs, capture_sizes
from worker.model.kernels import torch_ref, triton_attn

PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(7)]
PARAMS = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(7)]


def engine(path, graphs: str = "auto", async_scheduling: bool = False, max_running: int = 8,
           kv_cache_dtype: str = "auto") -> Engine:
    cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu", compile="off", cuda_graphs=graphs),
                       serving_tuning=ServingTuning(max_running_requests=max_running, max_total_tokens=2048,
                                                    async_scheduling=async_scheduling, kv_cache_dtype=kv_cache_dtype))
    return Engine.from_pretrained(str(path), cfg)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(compile_rules, "GRAPH_REPLAY", {"cpu": "emulated"})


def ids(eng: Engine) -> list[list[int]]:
    return [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]


def test_capture_sizes_are_vllms_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_an_unknown_setting_names_the_field_and_the_values():
    with pytest.raises(ConfigError, match=r"model.cuda_graphs must be one of \['auto', 'off'\], got 'on'"):
        ModelConfig(cuda_graphs="on")


def test_the_device_the_setting_and_the_back_end_decide():
    assert compile_rules.graphs_wanted("auto", "cuda", False, triton_attn) == ("cuda", "model.cuda_graphs is auto")
    assert compile_rules.graphs_wanted("off", "cuda", False, triton_attn) == (None, "model.cuda_graphs is off")
    assert compile_rules.graphs_wanted("auto", "cuda", True, triton_attn)[0] is None
    assert compile_rules.graphs_wanted("auto", "cuda", False, torch_ref) == \
        (None, "the attention back end torch_ref is not graph-safe")
    assert compile_rules.graphs_wanted("auto", "cpu", False, torch_ref) == (None, "")  # not considered: said nowhere


def test_cuda_replay_needs_a_cuda_device(llama_path):
    eng = engine(llama_path)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(eng.runner, 4, 64, "cuda")
    with pytest.raises(ValueError, match="replay must be one of"):
        DecodeGraphs(eng.runner, 4, 64, "fast")


def test_off_the_gpu_the_report_says_nothing_of_graphs(llama_path):
    report = engine(llama_path).compile_report
    assert report.cuda_graph_sizes == () and report.cuda_graph_reason == ""
    assert report.describe() == "eager (model.compile is off)"


@pytest.mark.parametrize("async_scheduling, kv_cache_dtype", [(False, "auto"), (True, "auto"), (False, "int8")],
                         ids=["sequential", "async", "int8-kv"])
def test_decode_steps_replay_padded_graphs_with_the_eager_tokens(llama_path, emulated, async_scheduling,
                                                                 kv_cache_dtype):
    eager = ids(engine(llama_path, "off", async_scheduling, kv_cache_dtype=kv_cache_dtype))
    eng = engine(llama_path, "auto", async_scheduling, kv_cache_dtype=kv_cache_dtype)
    report = eng.compile_report
    assert report.cuda_graph_sizes == (1, 2, 4, 8) and report.cuda_graph_reason == "model.cuda_graphs is auto"
    assert report.describe() == "eager (model.compile is off); decode graphs emulated for batches of 1-8 (4 sizes)"
    replayed = []
    real_run = eng.runner.graphs.run
    eng.runner.graphs.run = lambda i, p, md: replayed.append(i.shape[0]) or real_run(i, p, md)
    assert ids(eng) == eager
    # the batch shrank 7 -> 1 as requests ended: every size, most padded (7, 6, 5 in the 8-graph)
    assert set(replayed) == {1, 2, 3, 4, 5, 6, 7}
    assert eng.kv_stats().used_blocks == 0


def test_a_padding_row_writes_no_kv():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    key = torch.ones(3, 1, 2)
    torch_ref.write_kv(key, key * 2, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(8, 2)[[0, 5]].eq(1).all() and v_cache.view(8, 2)[[0, 5]].eq(2).all()
    assert k_cache.sum() == 4 and v_cache.sum() == 8  # the -1 row wrote nowhere


def test_a_capture_that_fails_leaves_the_steps_without_graphs(llama_path, emulated, monkeypatch, caplog):
    def broken(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "capture", broken)
    eng = engine(llama_path)
    report = eng.compile_report
    assert eng.runner.graphs is None and report.cuda_graph_sizes == ()
    assert report.cuda_graph_reason == "capturing failed: RuntimeError: operation not permitted when stream is capturing"
    assert report.describe().endswith("; no CUDA graphs (capturing failed: RuntimeError: operation not permitted "
                                      "when stream is capturing)")
    assert "decode steps run without graphs: capturing failed" in caplog.text
    assert ids(eng) == ids(engine(llama_path, "off"))


def test_graphs_that_read_a_stale_input_are_dropped(llama_path, emulated, monkeypatch):
    real_run = DecodeGraphs.run

    def forgets_positions(self, input_ids, position_ids, md):  # a replay reading last step's positions
        return real_run(self, input_ids, self.positions[: input_ids.shape[0]].clone(), md)

    monkeypatch.setattr(DecodeGraphs, "run", forgets_positions)
    eng = engine(llama_path)
    assert eng.runner.graphs is None
    assert eng.compile_report.cuda_graph_reason == "greedy ids on the graphs differ from the forward's without them"


def test_the_kv_cache_leaves_room_for_the_graphs(llama_path, monkeypatch):
    eng = engine(llama_path)
    loaded, tuning = eng.loaded, ServingTuning(max_running_requests=64)
    from worker.engine.engine import graph_reserve

    assert graph_reserve(loaded, ModelConfig(), tuning) == 0  # the CPU: no graphs
    monkeypatch.setattr(loaded, "device", torch.device("cuda"))
    assert graph_reserve(loaded, ModelConfig(), tuning) == 0  # CUDA, but a back end graphs cannot capture
    monkeypatch.setattr(loaded, "backend", triton_attn)
    cfg = loaded.model.config
    assert graph_reserve(loaded, ModelConfig(), tuning) == graph_mod.graph_memory_estimate(
        64, loaded.vocab_size, cfg.hidden_size, cfg.intermediate_size) > 64 * loaded.vocab_size * 4
    assert graph_reserve(loaded, ModelConfig(cuda_graphs="off"), tuning) == 0
