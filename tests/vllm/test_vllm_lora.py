"""LoRA adapters with `model.engine: vllm`: a job's adapter name becomes vLLM's
`LoRARequest` for `<model.lora_dir>/<name>` (worker/engine/vllm_core.py), checked first by
our own input processing against the facts the vLLM core sends in `Ready`.

One vLLM core with LoRA enabled serves the module; its greedy ids, per adapter in one
mixed batch, must equal Inflight's engine's on the same checkpoint and adapters (fp32)."""

from __future__ import annotations

import msgspec
import pytest

from schemas.params import SamplingParams
from schemas.wire import FinishReason
from tests.vllm.test_vllm_engine import Driver, greedy, vllm_config
from tools.make_lora import make_adapter
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine, RejectReason, RequestRejected
from worker.engine.core_client import ProcessEngineClient
from worker.engine.vllm_spec import VllmEngine, derived_engine_args

# rank 4 on every projection; rank 8 on two of them with a per-module alpha
ADAPTERS = {"a4": dict(rank=4), "b8": dict(rank=8, targets=("q_proj", "v_proj"), alpha_pattern={"v_proj": 4.0})}
WORK = [(f"w{i}", [(11 * i + 5 * j) % 400 + 7 for j in range(6 + 4 * i)], (None, "a4", "b8")[i % 3])
        for i in range(6)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def lora_dir(vllm_llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-loras")
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        kw = dict(kw)
        make_adapter(vllm_llama_path, root / name, kw.pop("rank"), seed=i + 1, **kw)
    return root


@pytest.fixture(scope="module")
def lora_driver(vllm_llama_path, vllm_python, lora_dir):
    cfg = vllm_config(vllm_python)  # max_loras 2: the two adapters fill every slot of a batch (vllm_plugin.py)
    cfg = EngineConfig(model=ModelConfig(**{**_fields(cfg.model), "lora_dir": str(lora_dir), "max_loras": 2}),
                       serving_tuning=ServingTuning(**{**_fields(cfg.serving_tuning), "max_running_requests": 4}))
    d = Driver(ProcessEngineClient(VllmEngine(str(vllm_llama_path), cfg, vllm_python), cfg.serving_tuning,
                                   log_level="WARNING"))
    yield d
    d.stop()


def _fields(struct) -> dict:
    return msgspec.structs.asdict(struct)


def ours(path, lora_dir) -> dict[str, list[int]]:
    """Greedy ids of WORK on Inflight's engine, all submitted at once."""
    eng = Engine.from_pretrained(str(path), EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu", lora_dir=str(lora_dir), max_loras=2),
        serving_tuning=ServingTuning(max_running_requests=4, max_total_tokens=4096)))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, prompt, adapter in WORK:
        eng.add_request(rid, prompt_token_ids=prompt, params=params, adapter=adapter)
    got: dict[str, list[int]] = {rid: [] for rid, *_ in WORK}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    return got


def test_each_adapter_gives_inflights_greedy_ids_in_one_mixed_batch(lora_driver, vllm_llama_path, lora_dir):
    lora_driver.submit(*(greedy(rid, prompt, MAX_TOKENS, adapter=adapter) for rid, prompt, adapter in WORK))
    lora_driver.wait(lambda: all(lora_driver.finished(rid) for rid, *_ in WORK))
    expected = ours(vllm_llama_path, lora_dir)
    got = {rid: [t for o in lora_driver.outputs[rid] for t in o.new_token_ids] for rid, *_ in WORK}
    assert got == expected
    for rid, *_ in WORK:
        assert lora_driver.outputs[rid][-1].finish_reason == FinishReason.LENGTH
    # the adapters change the continuation: the same prompt under base and each adapter differ
    base = {tuple(got[rid]) for rid, _, a in WORK if a is None}
    assert not base & {tuple(got[rid]) for rid, _, a in WORK if a is not None}


def test_an_adapter_the_worker_cannot_serve_is_rejected_before_the_engine(lora_driver, vllm_llama_path, lora_dir):
    """The facts our checks need (the model's LoRA projections) come from the vLLM core."""
    facts = lora_driver.client.input.facts.lora
    assert facts is not None and facts.lora_dir == str(lora_dir.resolve())
    assert "model.layers.0.self_attn.q_proj" in facts.modules
    with pytest.raises(RequestRejected) as e:
        lora_driver.client.input.process(greedy("nope", [5, 6], 3, adapter="missing"))
    assert e.value.reason == RejectReason.UNKNOWN_ADAPTER
    make_adapter(vllm_llama_path, lora_dir / "r32", 32, seed=9)  # above model.max_lora_rank (16)
    with pytest.raises(RequestRejected) as e:
        lora_driver.client.input.process(greedy("big", [5, 6], 3, adapter="r32"))
    assert e.value.reason == RejectReason.INVALID_ADAPTER and "rank" in e.value.message


def test_an_adapter_replaced_on_disk_is_served_afresh(lora_driver, vllm_llama_path, lora_dir):
    """vLLM never reloads an adapter id it holds: the id stands for the files as they are."""
    rid, prompt, _ = WORK[1]  # an a4 request
    before = ours(vllm_llama_path, lora_dir)[rid]
    make_adapter(vllm_llama_path, lora_dir / "a4", 4, seed=77)
    after = ours(vllm_llama_path, lora_dir)[rid]
    assert after != before
    lora_driver.submit(greedy("again", prompt, MAX_TOKENS, adapter="a4"))
    lora_driver.wait(lambda: lora_driver.finished("again"))
    assert [t for o in lora_driver.outputs["again"] for t in o.new_token_ids] == after


def test_lora_settings_become_vllms_engine_arguments():
    cfg = EngineConfig(model=ModelConfig(engine="vllm", vllm_python="/x", lora_dir="/adapters", max_loras=6,
                                         max_lora_rank=12),
                       serving_tuning=ServingTuning(max_loras_per_batch=3))
    args = derived_engine_args(cfg)
    assert args["enable_lora"] is True
    assert (args["max_loras"], args["max_cpu_loras"], args["max_lora_rank"]) == (3, 6, 16)  # vLLM's ranks: 8, 16, ...
    plain = derived_engine_args(EngineConfig(model=ModelConfig(engine="vllm", vllm_python="/x")))
    assert "enable_lora" not in plain
