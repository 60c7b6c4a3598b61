"""GPTQ checkpoints (AutoGPTQ / GPTQModel's `quant_method: gptq`): each quantized linear
layer's packed integers read into a `QuantLinear`.

The format, per layer (`bits` 4 or 8, `p = 32 / bits` values per int32 word, unsigned values
in `[0, 2^bits)`): `qweight` int32 `[in / p, out]` packed along the input channels (value
`j` of a word in bits `j*bits`), `qzeros` int32 `[groups, out / p]` packed along the output
channels, `scales` fp16 `[groups, out]`, `g_idx` int32 `[in]` the group of each input
channel (`i // group_size`, or any grouping with `desc_act`, GPTQ's activation order),
optional `bias`; `w[out, in] = (q - zero[g_idx[in]]) * scale[g_idx[in]]`. In the original
(`checkpoint_format: gptq`, "v1") layout the stored zero is one less than the zero the
kernels use (they add 1: exllama's and vLLM's convention, followed here); `gptq_v2`
stores it as is. Activation order is served by sorting the input channels by group
(`QuantLinear.perm`, the input gathered alike), as vLLM's GPTQ kernels do.
"""

from __future__ import annotations

import torch

from worker.model.capability import UnsupportedModel
from worker.model.quant_linear import QuantLinear, WeightScheme

FIELD = "config.quantization_config"
FORMATS = ("gptq", "gptq_v2")


def scheme_of(raw: dict, model_type: str) -> WeightScheme:
    """The layers' scheme from a GPTQ `quantization_config`.

    Raises:
        UnsupportedModel: bits other than 4 / 8, another checkpoint format (Marlin, BitBLAS).
    """
    bits, fmt = raw.get("bits"), raw.get("checkpoint_format", "gptq")
    if bits not in (4, 8):
        raise UnsupportedModel(model_type, f"GPTQ weights of {bits} bits", f"{FIELD}.bits", "served: 4, 8")
    if fmt not in FORMATS:
        raise UnsupportedModel(model_type, f"a GPTQ checkpoint in the {fmt!r} format", f"{FIELD}.checkpoint_format",
                               f"served: {', '.join(FORMATS)}")
    group = raw.get("group_size", -1)
    return WeightScheme(bits=bits, group_size=None if group in (-1, None) else int(group),
                        symmetric=bool(raw.get("sym", True)))


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their unsigned values (int32), `32 / bits` per word along `dim`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:  # [rows / p, cols] -> [rows, cols]
        v = (words[:, None, :] >> shifts[None, :, None]) & mask
        return v.reshape(-1, words.shape[1])
    v = (words[:, :, None] >> shifts[None, None, :]) & mask  # [rows, cols / p] -> [rows, cols]
    return v.reshape(words.shape[0], -1)


def read_layer(tensors, name: str, mod: torch.nn.Linear, scheme: WeightScheme, raw: dict,
               model_type: str) -> QuantLinear:
    """The `QuantLinear` of layer `name` from its GPTQ tensors (`tensors.has` / `.get`)."""
    n, k = mod.out_features, mod.in_features
    bits, half = scheme.bits, 1 << (scheme.bits - 1)
    q = _unpack(tensors.get(f"{name}.qweight"), bits, 0)[:k]  # [in, out], unsigned
    zeros = _unpack(tensors.get(f"{name}.qzeros"), bits, 1)[:, :n]  # [groups, out]
    if raw.get("checkpoint_format", "gptq") == "gptq":
        zeros = zeros + 1
    scales = tensors.get(f"{name}.scales").float()  # [groups, out]
    groups = scales.shape[0]
    g_idx = (tensors.get(f"{name}.g_idx").long() if tensors.has(f"{name}.g_idx")
             else torch.arange(k) // (scheme.group_size or k))
    perm = None
    if not torch.equal(g_idx, torch.arange(k) // (k // groups)):  # activation order: sort channels by group
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(torch.bincount(g_idx, minlength=groups), torch.full((groups,), k // groups)):
            raise UnsupportedModel(model_type, f"GPTQ groups of unequal sizes in {name}.g_idx", f"{name}.g_idx")
        q = q[perm]
    zero = None if scheme.symmetric else (zeros - half).t().to(torch.int8)
    if scheme.symmetric and not bool((zeros == half).all()):
        raise UnsupportedModel(model_type, f"zero points other than {half} in a symmetric GPTQ layer ({name})",
                               f"{FIELD}.sym")
    dev = mod.weight.device
    scheme_g = WeightScheme(bits=bits, group_size=None if groups == 1 else k // groups, symmetric=scheme.symmetric)
    return QuantLinear(k, n, scheme_g, (q - half).t().to(dev), scales.t().to(dev),
                       None if zero is None else zero.to(dev), mod.bias, None if perm is None else perm.to(dev))
