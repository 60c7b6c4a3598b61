"""Write a compressed-tensors checkpoint (the format llm-compressor writes) from a float
one, with compressed-tensors' own API: the scheme attached to every decoder linear layer
(`apply_quantization_config`), scales and zero points from each weight's min/max
(`calculate_qparams`: round-to-nearest, no calibration data), then the layers compressed
(`ModelCompressor`) and saved with their `quantization_config`.

    python -m tools.make_quantized SRC OUT --scheme w8a8
    python -m tools.make_quantized SRC OUT --scheme w4a16 --group-size 32 --asymmetric

Schemes: `w8a8` (int8 weights per channel, dynamic int8 activations per token; format
int-quantized), `w8a16` and `w4a16` (weight-only; pack-quantized), `fp8_dynamic` (FP8
E4M3 weights per channel, dynamic FP8 activations per token; float-quantized).

`--scheme awq` writes AutoAWQ's format instead (4-bit GEMM packing: `qweight` `[in, out /
8]` and `qzeros` `[groups, out / 8]` int32 with eight values per word in AWQ's order
0 2 4 6 1 3 5 7, `scales` `[groups, out]` fp16, unsigned values and zero points): round to
nearest per group, no activation-aware search. The packing is ours, checked against
compressed-tensors' `AutoAWQConverter` (tests/engine/test_quantization.py).

`--scheme gptq` writes GPTQ's original layout (values packed along the input channels,
zero points along the outputs and stored minus one, fp16 scales, `g_idx`; `--act-order`
groups a random order of the channels), round to nearest, no Hessian. Both packings equal
vLLM's packers (tests/vllm/test_vllm_packing.py).

`--scheme mxfp4` puts a GPT-OSS checkpoint's experts in MXFP4 as OpenAI ships them (E2M1
values in groups of 32 with a power-of-two scale); checked against transformers' own
dequantization.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SCHEMES = {"w8a8": (8, True), "w8a16": (8, False), "w4a16": (4, False), "fp8_dynamic": (8, True)}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of a packed word holds


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """`[rows, cols]` unsigned 4-bit values -> `[rows, cols / 8]` int32 in AWQ's order."""
    import torch

    rows, cols = values.shape
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = (v << shifts).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def awq_quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight `[out, in]` as AWQ's unsigned 4-bit values `[out, in]`, zero points and
    fp16 scales `[out, groups]` (min/max of each group, 0 representable)."""
    import torch

    n, k = w.shape
    wg = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = (torch.round(wg / scale.float()[..., None]) + zero[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.int32), zero.to(torch.int32), scale


def make_awq(src: Path, out: Path, group_size: int = 128) -> Path:
    """An AutoAWQ-format (GEMM, 4 bits) copy of `src`'s decoder linear layers in `out`."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    head = model.get_output_embeddings()
    tensors = {}
    for name, t in model.state_dict().items():
        tensors[name] = t.contiguous().clone()  # tied embeddings: one copy per name
    for name, m in model.named_modules():
        if type(m) is not torch.nn.Linear or m is head:
            continue
        q, zero, scale = awq_quantize(m.weight, group_size)
        del tensors[f"{name}.weight"]
        tensors[f"{name}.qweight"] = awq_pack(q.T.contiguous())
        tensors[f"{name}.qzeros"] = awq_pack(zero.T.contiguous())
        tensors[f"{name}.scales"] = scale.T.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                     "version": "gemm", "modules_to_not_convert": None}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def make_quantized(src: Path, out: Path, scheme: str, group_size: int | None = None,
                   symmetric: bool = True) -> Path:
    """Quantize `src` into `out` (created) and return `out`.

    Raises:
        ValueError: an unknown scheme, or W8A8 with groups or zero points.
    """
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {sorted(SCHEMES)}, got {scheme!r}")
    bits, act = SCHEMES[scheme]
    if act and (group_size or not symmetric):
        raise ValueError(f"{scheme} takes symmetric per-channel weights")
    kind = "float" if scheme.startswith("fp8") else "int"
    weights = QuantizationArgs(num_bits=bits, type=kind, symmetric=symmetric,
                               strategy="group" if group_size else "channel", group_size=group_size)
    acts = (QuantizationArgs(num_bits=8, type=kind, strategy="token", dynamic=True, symmetric=True)
            if act else None)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)},
        ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    apply_quantization_config(model, config)
    for _, m in model.named_modules():
        s = getattr(m, "quantization_scheme", None)
        if s is None or s.weights is None:
            continue
        w = m.weight.data
        wg = w.reshape(w.shape[0], -1, group_size) if group_size else w.unsqueeze(1)
        scale, zero = calculate_qparams(wg.amin(-1), wg.amax(-1), s.weights)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
    fmt = "float-quantized" if kind == "float" else "int-quantized" if act else "pack-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def gptq_quantize(w: torch.Tensor, bits: int, group_size: int, desc_act: bool, sym: bool,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest in GPTQ's terms: unsigned values `[out, in]`, zero points and fp16
    scales `[groups, out]`, and `g_idx` `[in]` (with `desc_act`, groups of a random order of
    the input channels, as activation order leaves them)."""
    import torch

    n, k = w.shape
    maxq = (1 << bits) - 1
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    groups = k // group_size
    scale = torch.empty(groups, n, dtype=torch.float16)
    zero = torch.empty(groups, n, dtype=torch.int32)
    for g in range(groups):
        cols = w.detach().float()[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            s = torch.maximum(-lo, hi) * 2 / maxq
            z = torch.full((n,), (maxq + 1) // 2)
        else:
            s = (hi - lo) / maxq
            z = torch.round(-lo / s.clamp(min=1e-8))
        scale[g] = s.clamp(min=1e-8).half()
        zero[g] = z.to(torch.int32)
    s_k, z_k = scale.float()[g_idx.long()].t(), zero[g_idx.long()].t()  # [out, in]
    q = torch.clamp(torch.round(w.detach().float() / s_k) + z_k, 0, maxq).to(torch.int32)
    return q, zero, scale, g_idx


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values -> int32 words, `32 / bits` per word along `dim` (value j at bits j*bits)."""
    import torch

    p = 32 // bits
    v = values.to(torch.int64)
    v = v.reshape(-1, p, v.shape[1]) if dim == 0 else v.reshape(v.shape[0], -1, p)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    word = (v << (shifts[None, :, None] if dim == 0 else shifts[None, None, :])).sum(1 if dim == 0 else 2)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def make_gptq(src: Path, out: Path, bits: int = 4, group_size: int = 32, desc_act: bool = False,
              sym: bool = True) -> Path:
    """A GPTQ checkpoint (`checkpoint_format: gptq`, the original layout: zero points stored
    minus one) of `src`'s decoder linear layers in `out`."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    head = model.get_output_embeddings()
    tensors = {name: t.contiguous().clone() for name, t in model.state_dict().items()}
    for i, (name, m) in enumerate(model.named_modules()):
        if type(m) is not torch.nn.Linear or m is head:
            continue
        q, zero, scale, g_idx = gptq_quantize(m.weight, bits, group_size, desc_act, sym, seed=i)
        del tensors[f"{name}.weight"]
        tensors[f"{name}.qweight"] = pack_int32(q.t().contiguous(), bits, 0)
        tensors[f"{name}.qzeros"] = pack_int32((zero - 1) & ((1 << bits) - 1), bits, 1)
        tensors[f"{name}.scales"] = scale
        tensors[f"{name}.g_idx"] = g_idx
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                     "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


# FP4 (E2M1) code -> value: codes 0-7 positive, 8-15 their negatives (the OCP MX format)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., rows, cols]` float -> MXFP4 as GPT-OSS stores it: blocks `[..., rows, cols / 32,
    16]` uint8 (two E2M1 codes per byte, the even column in the low nibble) and scales
    `[..., rows, cols / 32]` uint8 (an E8M0 power of two, biased by 127), one per 32
    values: the smallest power of two that brings the group's largest value within 6,
    each value then rounded to the nearest code."""
    import torch

    *lead, rows, cols = w.shape
    g = w.detach().float().reshape(*lead, rows, cols // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp)[..., None]
    values = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - values).abs().argmin(-1).to(torch.uint8)  # ties: the first (positive) code
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def make_mxfp4(src: Path, out: Path) -> Path:
    """A copy of a GPT-OSS checkpoint (`src`, float) with its experts in MXFP4, as OpenAI
    ships GPT-OSS: `*.mlp.experts.{gate_up,down}_proj` `[experts, in, out]` become
    `_blocks` / `_scales` over `[experts, out, in]`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_quantize(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="a float Hugging Face checkpoint directory")
    p.add_argument("out", type=Path)
    p.add_argument("--scheme", choices=[*sorted(SCHEMES), "awq", "gptq", "mxfp4"], default="w8a8",
                   help="mxfp4: the experts of a GPT-OSS checkpoint, as OpenAI ships it")
    p.add_argument("--group-size", type=int, default=None, help="input channels per scale (default: per channel)")
    p.add_argument("--asymmetric", action="store_true", help="zero points (weight-only schemes)")
    p.add_argument("--bits", type=int, default=4, choices=[4, 8], help="gptq: bits per weight")
    p.add_argument("--act-order", action="store_true", help="gptq: desc_act (groups in a random channel order)")
    a = p.parse_args(argv)
    if a.scheme == "awq":
        make_awq(a.src, a.out, a.group_size or 128)
    elif a.scheme == "mxfp4":
        make_mxfp4(a.src, a.out)
    elif a.scheme == "gptq":
        make_gptq(a.src, a.out, a.bits, a.group_size or 128, a.act_order, not a.asymmetric)
    else:
        make_quantized(a.src, a.out, a.scheme, a.group_size, not a.asymmetric)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
