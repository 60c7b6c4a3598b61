"""Write a compressed-tensors checkpoint (the format llm-compressor writes) from a float
one, with compressed-tensors' own API: the scheme attached to every decoder linear layer
(`apply_quantization_config`), scales and zero points from each weight's min/max
(`calculate_qparams`: round-to-nearest, no calibration data), then the layers compressed
(`ModelCompressor`) and saved with their `quantization_config`.

    python -m tools.make_quantized SRC OUT --scheme w8a8
    python -m tools.make_quantized SRC OUT --scheme w4a16 --group-size 32 --asymmetric

Schemes: `w8a8` (int8 weights per channel, dynamic int8 activations per token; format
int-quantized), `w8a16` and `w4a16` (weight-only; pack-quantized).
"""

from __future__ import annotations

import argparse
from pathlib import Path

SCHEMES = {"w8a8": (8, True), "w8a16": (8, False), "w4a16": (4, False)}


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
        raise ValueError("w8a8 takes symmetric per-channel weights")
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                               strategy="group" if group_size else "channel", group_size=group_size)
    acts = (QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True)
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
    fmt = "int-quantized" if act else "pack-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="a float Hugging Face checkpoint directory")
    p.add_argument("out", type=Path)
    p.add_argument("--scheme", choices=sorted(SCHEMES), default="w8a8")
    p.add_argument("--group-size", type=int, default=None, help="input channels per scale (default: per channel)")
    p.add_argument("--asymmetric", action="store_true", help="zero points (weight-only schemes)")
    a = p.parse_args(argv)
    make_quantized(a.src, a.out, a.scheme, a.group_size, not a.asymmetric)
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
