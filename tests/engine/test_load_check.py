"""The load check refuses what the paged runner would get wrong, on real modules made to
misbehave the ways real architectures do: attention computed outside transformers'
attention interface (BLOOM without its adapter), state that mixes the packed batch's
sequences (what a Mamba or convolution mixer does), a window its masks and its attention
call disagree on. And what it measures is what the engine allocates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import arch_checkpoint
from worker.config import ModelConfig
from worker.model.attention import ATTN_IMPLEMENTATION
from worker.model.capability import UnsupportedModel
from worker.model.kernels import torch_ref
from worker.model.load_check import compare_with_reference, measure_layers
from worker.model.loader import _measure, load_model


def paged(family: str):
    return AutoModelForCausalLM.from_pretrained(str(arch_checkpoint(family)), dtype=torch.float32,
                                                attn_implementation=ATTN_IMPLEMENTATION).eval()


def test_attention_outside_the_interface_is_refused():
    model = paged("BLOOM")  # its attention never calls the interface; the adapter is not installed here
    with pytest.raises(UnsupportedModel, match=r"bypasses transformers' attention interface \(layer 0, BloomAttention"):
        measure_layers(model, model.config, "bloom", torch_ref)


def test_one_layer_computing_its_own_attention_is_refused():
    model = paged("Llama")
    attn = model.model.layers[1].self_attn
    attn.forward = lambda hidden_states, *a, **k: (attn.o_proj(torch.zeros(
        *hidden_states.shape[:-1], attn.o_proj.in_features)), None)
    with pytest.raises(UnsupportedModel, match=r"layer 1, LlamaAttention at model.layers.1.self_attn"):
        measure_layers(model, model.config, "llama", torch_ref)


def test_state_mixing_the_packed_sequences_is_refused():
    """A token mixer outside attention (here: a running mean over the sequence, added to
    one MLP) sees the packed batch as one sequence: the logits differ from each sequence
    run alone, and the model is refused with the numbers."""
    model = paged("Llama")
    mlp = model.model.layers[0].mlp
    inner = mlp.forward
    mlp.forward = lambda x: inner(x) + x.cumsum(1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1)
    layout, _, _ = _measure(model, model.config, "llama", torch_ref)
    with pytest.raises(UnsupportedModel, match=r"does not reproduce .*differ from transformers' eager attention"):
        compare_with_reference(model, layout, torch_ref, "llama", model.config.vocab_size)


def test_the_unmodified_model_passes_within_fp32_noise():
    model = paged("Llama")
    layout, features, _ = _measure(model, model.config, "llama", torch_ref)
    assert compare_with_reference(model, layout, torch_ref, "llama", model.config.vocab_size) < 1e-4
    assert features == [] and layout.sliding_window is None


def test_a_window_its_masks_do_not_apply_is_refused():
    model = paged("Gemma 3")
    model.config.layer_types = ["full_attention", "full_attention"]  # masks: full; layer 0 still asks for 16
    with pytest.raises(UnsupportedModel, match=r"disagree on \(layer 0: config None, attention call 16\)"):
        measure_layers(model, model.config, "gemma3_text", torch_ref)


@pytest.mark.parametrize("family,features,window", [
    ("Gemma 2", ["sliding window 16 on 1 of 2 layers", "attention logit soft-capping",
                 "final logit soft-capping (in the model)"], None),
    ("GPT-OSS", ["sliding window 16 on 1 of 2 layers", "attention sinks"], None),
    ("Mistral (sliding window)", ["sliding window 16 on 2 of 2 layers"], 16),
    ("BLOOM", ["attention outside the interface (adapter: BloomAttention)", "ALiBi"], None),
])
def test_verdict_names_the_features(family, features, window):
    loaded = load_model(ModelConfig(path=str(arch_checkpoint(family)), dtype="float32", device="cpu"))
    assert list(loaded.features) == features and loaded.kv_layout.sliding_window == window
    assert loaded.verdict().startswith("supported (") and loaded.load_check_error < 1e-3


def test_latent_kv_layout_is_measured_not_guessed():
    """DeepSeek-V3 (4 heads, kv_lora_rank 32, rope 8, qk 24 / v 16 per head): one latent
    of 40 values per token per layer, against 4 x (24 + 16) = 160 decompressed."""
    loaded = load_model(ModelConfig(path=str(arch_checkpoint("DeepSeek-V3")), dtype="float32", device="cpu"))
    layer = loaded.kv_layout.layers[0]
    assert (layer.num_kv_heads, layer.head_dim, layer.v_head_dim, layer.value_in_key) == (1, 40, 32, True)
    assert loaded.kv_layout.bytes_per_token(torch.float32) == 2 * 40 * 4
    assert "latent KV cache (40 values per token per layer)" in loaded.features


def test_an_unreadable_weights_file_is_named_with_its_mode_not_reported_missing(tmp_path, monkeypatch):
    """safetensors says "No such file or directory" for a weights file it may not read (a
    0600 checkpoint mounted into a container running as another user): the loader says
    what it is. Root reads everything, so the access check is what the test narrows."""
    import os

    from worker.model import loader

    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    weights.chmod(0o600)
    real_access = os.access
    monkeypatch.setattr(loader.os, "access", lambda p, mode: Path(p) != weights and real_access(p, mode))
    with pytest.raises(PermissionError, match=r"not readable by this process \(uid \d+\): model\.safetensors "
                                              r"\(mode -rw-------, owner uid \d+\); .*chmod -R a\+rX"):
        load_model(ModelConfig(path=str(tmp_path), device="cpu"))
