"""Quantized weights (issue 46) on the tiny real models, on the CPU: compressed-tensors
checkpoints written by the format's own library (`tools/make_quantized.py`) and float
checkpoints quantized at load (`model.quantization`). Every request of a batch with chunked
prefill and preemption yields the greedy ids of a reference that owes nothing to our
engine: transformers running the same checkpoint (W8A8, which transformers serves with
compressed-tensors), or transformers' float model holding the weights compressed-tensors
itself decompresses (formats transformers cannot load) or `QuantLinear.dequantized`
(weight-only at load). Unsupported schemes are refused at load with one line."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas.params import SamplingParams
from tests.conftest import tiny_checkpoint
from tools.make_quantized import make_awq, make_gptq, make_mxfp4, make_quantized
from worker.config import ConfigError, EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine
from worker.model.capability import UnsupportedModel
from worker.model.quant_linear import QuantLinear, WeightScheme, pack_int4, quantize_weight, unpack_int4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("quantized")
    return {
        "w8a8": make_quantized(base, root / "w8a8", "w8a8"),
        "w4a16_asym": make_quantized(base, root / "w4a16-asym", "w4a16", group_size=32, symmetric=False),
        "w8a16_group": make_quantized(base, root / "w8a16-g16", "w8a16", group_size=16),
        "fp8_dynamic": make_quantized(base, root / "fp8-dynamic", "fp8_dynamic"),
    }


def workload(seed: int = 1, n: int = 12) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(32)]
    return [(f"r{i}", shared + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 90))], rng.choice([5, 17, 40]))
            for i in range(n)]


def run(path: Path, work, async_scheduling: bool = False, **model) -> tuple[dict[str, list[int]], Engine]:
    eng = Engine.from_pretrained(str(path), EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu", **model),
        serving_tuning=ServingTuning(max_total_tokens=384, max_batched_tokens=32, max_running_requests=8,
                                     async_scheduling=async_scheduling)))
    for rid, prompt, n in work:
        eng.add_request(rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=n, temperature=0,
                                                                           ignore_eos=True))
    got: dict[str, list[int]] = {rid: [] for rid, *_ in work}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.finish_reason in (None, "length"), (o.request_id, o.error_message)
            got[o.request_id].extend(o.new_token_ids)
    return got, eng


def generate(model: torch.nn.Module, work) -> dict[str, list[int]]:
    refs = {}
    with torch.no_grad():
        for rid, prompt, n in work:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            refs[rid] = out[0, len(prompt):].tolist()
    return refs


def dequantized_at_load(path: Path, method: str) -> torch.nn.Module:
    """transformers' float model of `path` whose linear layers hold the weights `method`
    quantizes them to at load (`QuantLinear.dequantized`): the reference of weight-only
    schemes."""
    from worker.model.quant_load import quantize_at_load

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    quantized = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert quantize_at_load(quantized, method) > 0
    layers = dict(quantized.named_modules())
    for name, m in ref.named_modules():
        if isinstance(layers.get(name), QuantLinear):
            m.weight.data.copy_(layers[name].dequantized())
    return ref


def decompressed_reference(path: Path) -> torch.nn.Module:
    """transformers' float model of `path` holding the weights compressed-tensors' own
    compressor decompresses (`PackedQuantizationCompressor.decompress`)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    qc = QuantizationConfig.model_validate(
        {k: v for k, v in config.quantization_config.items() if k not in ("sparsity_config", "transform_config")})
    scheme = qc.config_groups["group_0"]
    del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    tensors = load_file(path / "model.safetensors")
    for name, mod in model.named_modules():
        if f"{name}.weight_packed" in tensors:
            local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".weight_")}
            mod.weight.data.copy_(PackedQuantizationCompressor.decompress(local, scheme)["weight"])
    return model.eval()


# Where rounding activations to int8 makes two exact computations part: a near tie of the
# reference's two best logits (x their std); the divergences seen were 0.004 and 0.007.
NEAR_TIE = 0.02


def assert_equal_up_to_near_ties(got: dict[str, list[int]], refs: dict[str, list[int]], ref_model, work,
                                 min_identical: int) -> None:
    """Activations rounded to int8 or FP8 at each layer turn last-bit float differences (the
    paged attention's order of sums, the integer matmul's exact accumulation, a cached
    decode against a full forward) into a whole quantization step now and then, so an
    exact greedy match holds only up to such a rounding: each request equals its reference
    up to its first divergence, where either transformers' own forward of the whole
    sequence (no KV cache) picks our token — `generate`'s cached decode parted from it (seen
    with FP8) — or its two best logits are within NEAR_TIE x std and ours is the runner-up;
    at least `min_identical` requests equal theirs whole."""
    for rid, prompt, _ in work:
        if got[rid] == refs[rid]:
            continue
        i = next(k for k, (a, b) in enumerate(zip(got[rid], refs[rid])) if a != b)
        with torch.no_grad():
            logits = ref_model(torch.tensor([prompt + refs[rid][:i]])).logits[0, -1]
        top = logits.topk(2)
        if got[rid][i] == int(top.indices[0]):
            continue
        margin = float(top.values[0] - top.values[1]) / float(logits.std())
        assert got[rid][i] == int(top.indices[1]) and margin < NEAR_TIE, (rid, i, margin)
    assert sum(got[rid] == refs[rid] for rid, *_ in work) >= min_identical


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sequential", "async"])
def test_a_w8a8_checkpoint_equals_transformers_running_it(checkpoints, async_scheduling):
    """transformers serves compressed-tensors W8A8 itself (weights decompressed, activations
    fake-quantized per token): its generate is the reference, over chunked prefill (32-token
    steps) and preemption (384 tokens of KV); equal up to near ties (10 of 12 whole here)."""
    work = workload()
    got, eng = run(checkpoints["w8a8"], work, async_scheduling)
    assert eng.scheduler.num_preemptions_total > 0
    assert any("compressed-tensors W8A8" in f for f in eng.loaded.features), eng.loaded.features
    ref_model = AutoModelForCausalLM.from_pretrained(checkpoints["w8a8"]).eval()
    refs = generate(ref_model, work)
    assert_equal_up_to_near_ties(got, refs, ref_model, work, min_identical=9)
    plain = generate(AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama")).eval(), work)
    assert plain != refs  # the quantization changes some output: the reference is not the float model


def test_an_fp8_dynamic_checkpoint_equals_transformers_running_it(checkpoints):
    """compressed-tensors FP8-dynamic (E4M3 weights per channel, activations rounded to E4M3
    per token), which transformers runs itself: its generate is the reference, up to near
    ties; on the CPU the weight is dequantized once at load."""
    from worker.model.quant_linear import Fp8Linear

    work = workload(8)
    got, eng = run(checkpoints["fp8_dynamic"], work, async_scheduling=True)
    layers = [m for m in eng.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 14 and all(m.act == "token" and m.weight is not None for m in layers)
    ref_model = AutoModelForCausalLM.from_pretrained(checkpoints["fp8_dynamic"]).eval()
    assert_equal_up_to_near_ties(got, generate(ref_model, work), ref_model, work, min_identical=9)


@pytest.mark.parametrize("name", ["w4a16_asym", "w8a16_group"])
def test_packed_weight_only_checkpoints_equal_the_library_decompressed_weights(checkpoints, name):
    """Asymmetric int4 in groups of 32 (packed zero points: transformers 5.24 cannot load
    them) and int8 in groups of 16: each layer's weight equals compressed-tensors' own
    decompression exactly, and the engine's greedy ids equal transformers' float model
    holding those weights."""
    ref_model = decompressed_reference(checkpoints[name])
    work = workload(2)
    got, eng = run(checkpoints[name], work)
    layers = {n: m for n, m in eng.runner.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 14
    ref_weights = dict(ref_model.named_modules())
    for n, m in layers.items():
        assert torch.equal(m.dequantized(), ref_weights[n].weight.data), n
    assert got == generate(ref_model, work)


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8_int8", "fp8"])
def test_quantized_at_load_equals_the_reference_on_the_same_layers(method):
    """A float checkpoint quantized while loading: the engine equals transformers' generate
    on the same model with the same `QuantLinear`s (weight-only: its float model holding
    the dequantized weights), over chunked prefill and preemption."""
    from worker.model import quant_load
    from worker.model.quant_load import quantize_at_load

    path = tiny_checkpoint("qwen2")
    work = workload(3)
    got, eng = run(path, work, quantization=method)
    if method in ("int8", "int4"):  # weight-only: a float model with the dequantized weights
        ref = dequantized_at_load(path, method)
    else:  # the same layers, activations rounded by them
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert quantize_at_load(ref, method) == 14
    refs = generate(ref, work)
    if method in ("w8a8_int8", "fp8"):  # activations rounded at each layer
        assert_equal_up_to_near_ties(got, refs, ref, work, min_identical=9)
    else:
        assert got == refs
    assert len(quant_load.describe_layers(eng.runner.model)) == 1


def test_quantize_pack_and_dequantize_round_trip():
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    for scheme in (WeightScheme(bits=8), WeightScheme(bits=4, group_size=64),
                   WeightScheme(bits=4, group_size=32, symmetric=False), WeightScheme(bits=8, act_int8=True)):
        q, scale, zero = quantize_weight(w, scheme)
        assert q.dtype == torch.int8 and int(q.min()) >= scheme.qmin and int(q.max()) <= scheme.qmax
        layer = QuantLinear(256, 48, scheme, q, scale, zero)
        assert torch.equal(layer.int_weight(), q)
        step = scale.repeat_interleave(256 // scale.shape[1], dim=1)
        assert (layer.dequantized() - w).abs().le(step * 0.5001).all()  # within half a step everywhere
        if scheme.bits == 4:
            assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (48, 128)
    q = torch.randint(-8, 8, (5, 12), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_w8a8_is_the_integer_matmul_of_the_rounded_activations():
    """y = round(x / sx) @ q.T * sx * scale (sx = max|x| / 127.5, compressed-tensors'
    rule), as the float arithmetic of the same integers, for single rows and batches, with
    a bias."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 40)
    layer = QuantLinear.quantize(lin, WeightScheme(bits=8, act_int8=True))
    for rows in (1, 7, 33):
        x = torch.randn(rows, 64)
        sx = x.abs().amax(-1, keepdim=True) / 127.5
        xq = torch.round(x / sx).clamp(-128, 127)
        ref = (xq.double() @ layer.int_weight().double().T) * sx.double() * layer.scale.double().T + lin.bias.double()
        assert torch.allclose(layer(x).double(), ref, rtol=1e-5, atol=1e-6)


def test_an_awq_checkpoint_equals_its_dequantized_weights(tmp_path):
    """AutoAWQ's GEMM format (packed by `tools.make_quantized.make_awq`, read through
    compressed-tensors' `AutoAWQConverter`): each layer's weight is exactly (q - zero) x
    scale of the values written, and the engine's greedy ids equal transformers' float
    model holding those weights, over chunked prefill and preemption."""
    from tools.make_quantized import awq_quantize

    base = tiny_checkpoint("qwen2")  # q/k/v carry biases
    path = make_awq(base, tmp_path / "awq", group_size=32)
    ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    for m in ref.modules():
        if type(m) is torch.nn.Linear and m is not ref.get_output_embeddings():
            q, zero, scale = awq_quantize(m.weight, 32)
            n, k = q.shape
            w = (q.reshape(n, -1, 32) - zero[..., None]).float() * scale.float()[..., None]
            m.weight.data.copy_(w.reshape(n, k))
    work = workload(7)
    got, eng = run(path, work)
    assert any(f.startswith("AWQ W4A16 (int4 weights, groups of 32, asymmetric)") for f in eng.loaded.features), \
        eng.loaded.features
    layers = {n: m for n, m in eng.runner.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 14
    ref_modules = dict(ref.named_modules())
    for n, m in layers.items():
        assert torch.equal(m.dequantized(), ref_modules[n].weight.data), n
    assert eng.scheduler.num_preemptions_total > 0
    assert got == generate(ref, work)


def test_an_mxfp4_gpt_oss_checkpoint_is_dequantized_at_load_as_transformers_does(tmp_path):
    """GPT-OSS with its experts in MXFP4 (`tools.make_quantized.make_mxfp4`): transformers'
    own dequantization at load gives each expert weight exactly FP4 value x 2^scale of what
    was written, and the engine's greedy ids equal transformers' generate on that model."""
    from transformers import Mxfp4Config

    from tests.conftest import arch_checkpoint
    from tools.make_quantized import FP4_VALUES, mxfp4_quantize

    base = arch_checkpoint("GPT-OSS")
    path = make_mxfp4(base, tmp_path / "mxfp4")
    work = workload(9, 6)
    got, eng = run(path, work)
    assert any("MXFP4" in f for f in eng.loaded.features), eng.loaded.features
    ref = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True),
                                               dtype=torch.float32).eval()
    float_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    w = float_model.model.layers[0].mlp.experts.gate_up_proj.detach()
    blocks, scales = mxfp4_quantize(w.transpose(1, 2).contiguous())
    codes = torch.stack((blocks & 15, blocks >> 4), -1).reshape(*blocks.shape[:-1], 32).long()
    expect = (torch.tensor(FP4_VALUES)[codes] * torch.exp2(scales.float() - 127)[..., None]).flatten(-2)
    assert torch.equal(ref.model.layers[0].mlp.experts.gate_up_proj.detach(), expect.transpose(1, 2))
    assert got == generate(ref, work)


@pytest.mark.parametrize("bits, group, sym, desc_act", [(4, 32, True, False), (4, 32, False, True),
                                                        (8, 16, True, True)])
def test_a_gptq_checkpoint_equals_its_dequantized_weights(tmp_path, bits, group, sym, desc_act):
    """GPTQ's layout (`tools.make_quantized.make_gptq`: values packed along the input
    channels, zero points along the outputs and stored minus one, `g_idx`; activation order
    as a random grouping of the channels): each layer's weight is exactly (q - zero) x
    scale of its group, and the engine's greedy ids equal transformers' float model holding
    those weights, over chunked prefill and preemption."""
    from tools.make_quantized import gptq_quantize

    base = tiny_checkpoint("llama")
    path = make_gptq(base, tmp_path / "gptq", bits, group, desc_act, sym)
    ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    head = ref.get_output_embeddings()
    for i, (_, m) in enumerate(ref.named_modules()):
        if type(m) is torch.nn.Linear and m is not head:
            q, zero, scale, g_idx = gptq_quantize(m.weight, bits, group, desc_act, sym, seed=i)
            z = ((zero - 1) & ((1 << bits) - 1)) + 1  # what the stored zero decodes to
            g = g_idx.long()
            m.weight.data.copy_((q - z[g].t()).float() * scale.float()[g].t())
    work = workload(10)
    got, eng = run(path, work)
    layers = {n: m for n, m in eng.runner.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 14 and all((m.perm is not None) == desc_act for m in layers.values())
    ref_modules = dict(ref.named_modules())
    for n, m in layers.items():
        assert torch.equal(m.dequantized(), ref_modules[n].weight.data), n
    assert eng.scheduler.num_preemptions_total > 0
    assert got == generate(ref, work)


def _with_quantization_config(tmp_path: Path, qc: dict) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _fp8_block_group() -> dict:
    w = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128], "symmetric": True,
         "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}}


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "weights quantized with 'bitsandbytes' "
     "(config.quantization_config.quant_method); not supported"),
    ({"quant_method": "gptq", "bits": 3}, "GPTQ weights of 3 bits (config.quantization_config.bits)"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "a GPTQ checkpoint in the 'marlin' format "
     "(config.quantization_config.checkpoint_format)"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "an AWQ checkpoint (Unsupported AutoAWQ version: gemv) "
     "(config.quantization_config.version)"),
    ({"quant_method": "awq", "bits": 8}, "(config.quantization_config.bits)"),
    (_fp8_block_group(), "FP8 weight scales by block (served: channel, tensor) "
     "(config.quantization_config.config_groups.group_0.weights.strategy)"),
    ({**_fp8_block_group(), "format": "nvfp4-pack-quantized"}, "compressed-tensors format 'nvfp4-pack-quantized' "
     "(config.quantization_config.config_groups.group_0.format)"),
])
def test_an_unsupported_quantization_is_refused_with_one_line(tmp_path, qc, words):
    with pytest.raises(UnsupportedModel) as e:
        Engine.from_pretrained(str(_with_quantization_config(tmp_path, qc)),
                               EngineConfig(model=ModelConfig(device="cpu")))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_quantizing_a_quantized_checkpoint_or_an_unknown_method_is_a_config_error(checkpoints):
    with pytest.raises(ConfigError, match="model.quantization is 'int8' but the checkpoint is already quantized"):
        Engine.from_pretrained(str(checkpoints["w8a8"]),
                               EngineConfig(model=ModelConfig(device="cpu", quantization="int8")))
    with pytest.raises(ConfigError, match=r"model.quantization must be one of \['fp8', 'int4', 'int8', 'none', "
                                          r"'w8a8_int8'\], got 'fp4'"):
        ModelConfig(quantization="fp4")
    with pytest.raises(ConfigError, match="model.vllm_args: quantization"):
        ModelConfig(engine="vllm", vllm_python="python", quantization="int8")


def test_lora_adds_its_delta_on_top_of_a_quantized_base(tmp_path):
    """An adapter over int8 weight-only layers equals transformers' generate on the
    dequantized float model with the adapter merged by peft."""
    from peft import PeftModel

    from tools.make_lora import make_adapter

    base = tiny_checkpoint("llama")
    make_adapter(base, tmp_path / "a4", 4, seed=1, targets=("q_proj", "v_proj", "down_proj"))
    work = workload(4, 6)
    eng = Engine.from_pretrained(str(base), EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu", quantization="int8", lora_dir=str(tmp_path)),
        serving_tuning=ServingTuning(max_total_tokens=4096, max_batched_tokens=256, max_running_requests=8)))
    for rid, prompt, n in work:
        eng.add_request(rid, prompt_token_ids=prompt, adapter="a4",
                        params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    got: dict[str, list[int]] = {rid: [] for rid, *_ in work}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    ref = dequantized_at_load(base, "int8")
    merged = PeftModel.from_pretrained(ref, str(tmp_path / "a4")).merge_and_unload().eval()
    assert got == generate(merged, work)


@pytest.mark.parametrize("family", ["DeepSeek-V3", "Gemma 2"])
def test_other_architectures_quantize_at_load_and_stay_exact(family):
    """MLA (DeepSeek-V3: `kv_b_proj` stays float for the latent KV cache; MoE experts stay
    float) and windows with soft-capping (Gemma 2): int8 weight-only at load equals
    transformers' generate on the float model holding the dequantized weights."""
    from tests.conftest import arch_checkpoint

    path = arch_checkpoint(family)
    work = workload(5, 6)
    got, eng = run(path, work, quantization="int8")
    model = eng.runner.model
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) > 0
    assert all(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n.endswith("kv_b_proj"))
    assert got == generate(dequantized_at_load(path, "int8"), work)


@pytest.mark.parametrize("method", ["int4", "int8", "w8a8_int8", "fp8"])
def test_a_quantized_forward_is_captured_and_compiled_like_a_float_one(method, tmp_path, monkeypatch):
    """`model.compile: on` (the CPU's default): the quantized forward is captured ahead of
    time, not left eager (a guard on the step's unbacked token count once sent int4 back
    to eager), and its greedy ids are the eager engine's (W8A8: up to near ties)."""
    from worker.engine import compile as compile_rules
    from worker.model import compiled
    from worker.model.quant_load import quantize_at_load

    monkeypatch.setattr(compile_rules, "precompiled_dir", lambda: tmp_path / "precompiled")
    path = tiny_checkpoint("llama")
    work = workload(6, 8)
    got, eng = run(path, work, quantization=method, compile="on")
    report = eng.compile_report
    assert report.compiled and not report.capture_fallback, report
    if compiled.precompile_available("cpu"):
        assert report.artifact == "captured", report
    eager, _ = run(path, work, quantization=method, compile="off")
    if method in ("w8a8_int8", "fp8"):
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        quantize_at_load(ref, method)
        assert_equal_up_to_near_ties(got, eager, ref, work, min_identical=6)
    else:
        assert got == eager
