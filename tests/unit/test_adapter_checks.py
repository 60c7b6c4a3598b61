"""An adapter that names a module this model lacks is refused with the first concrete
mismatch (a layer beyond the model, a projection its layers do not have, an MoE expert)
and the base model its config names; no model needed (AdapterCatalog over module shapes)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from worker.engine.adapters import AdapterCatalog, AdapterError, absent_module_reason

# a 4-layer dense model's LoRA targets: name -> (in, out) features
MODULES = {f"model.layers.{i}.{p}": (64, 64) for i in range(4)
           for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def adapter(root, name: str, module: str, base: str | None = "org/deeper-model-8b"):
    d = root / name
    d.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    if base:
        cfg["base_model_name_or_path"] = base
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({f"base_model.model.{module}.lora_A.weight": torch.zeros(4, 64),
               f"base_model.model.{module}.lora_B.weight": torch.zeros(64, 4)}, d / "adapter_model.safetensors")


@pytest.mark.parametrize(("module", "needle"), [
    ("model.layers.3.mlp.down_proj", None),  # served
    ("model.layers.7.mlp.down_proj", "layer 7 is beyond this model's 4 decoder layers"),
    ("model.layers.1.mlp.gate_up_proj", "layer 1 of this model has no 'mlp.gate_up_proj' (its projections: "
                                        "mlp.down_proj, mlp.gate_proj, mlp.up_proj, self_attn.k_proj"),
    ("model.layers.2.block_sparse_moe.experts.0.w1", "an MoE expert"),
    ("lm_head", "not in this model's decoder layers"),
])
def test_a_missing_module_is_named_with_its_concrete_mismatch_and_the_adapters_base(tmp_path, module, needle):
    adapter(tmp_path, "x", module)
    catalog = AdapterCatalog(str(tmp_path), 16, MODULES)
    if needle is None:
        assert catalog.resolve("x").modules.keys() == {module}
        return
    with pytest.raises(AdapterError) as e:
        catalog.resolve("x")
    assert e.value.code == "invalid_adapter"
    assert needle in e.value.message and "the adapter names base model 'org/deeper-model-8b'" in e.value.message


def test_without_a_base_model_in_its_config_the_reason_stands_alone(tmp_path):
    adapter(tmp_path, "x", "model.layers.9.self_attn.q_proj", base=None)
    with pytest.raises(AdapterError) as e:
        AdapterCatalog(str(tmp_path), 16, MODULES).resolve("x")
    assert e.value.message.endswith("layer 9 is beyond this model's 4 decoder layers")


def test_a_layer_stack_this_model_does_not_have_is_named():
    assert absent_module_reason("transformer.layers.0.attn.c_attn", MODULES).endswith(
        "this model has no layer stack 'transformer.layers'")
