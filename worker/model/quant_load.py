"""Quantized weights at load: a checkpoint's `quantization_config` read and checked, its
quantized layers installed as `QuantLinear`s (integers) or `Fp8Linear`s, or a float
checkpoint quantized while it loads (`model.quantization`).

Served checkpoints: **compressed-tensors** (what llm-compressor writes) with integer weights
of 4 or 8 bits, per-channel or group scales, symmetric or asymmetric, weight-only or with
dynamic per-token int8 activations (W8A8), in its `int-quantized`, `pack-quantized` and
`naive-quantized` formats, or FP8 E4M3 weights per channel or per tensor with activations
kept, dynamic per token or static (`float-quantized`); and **AWQ** (AutoAWQ's 4-bit GEMM
packing), whose layers compressed-tensors' own converter (`AutoAWQConverter`) turns into
its format as they are read; **GPTQ** (4 or 8 bits, groups, activation order; `gptq.py`);
and **MXFP4** (GPT-OSS's experts), which transformers dequantizes while loading (float
memory: no FP4 kernel here). The format's own library parses and validates the config
(`compressed_tensors.QuantizationConfig`), matches its targets to modules
(`match_named_modules`) and unpacks packed values (`unpack_from_int32`); the tensors are
read from the checkpoint's safetensors files here, since transformers' loader for this
format fails on asymmetric packed zero points (transformers 5.24, compressed-tensors 0.20).

Everything else — another `quant_method` (block-scaled `fp8`, bitsandbytes, HQQ, ...), AWQ's other packings (GEMV, Marlin, ...), block and 4-bit float schemes, activation
orderings with a `g_idx`, output or KV-cache quantization, sparsity, transforms — is refused at load with one line naming the method and the config
field (`UnsupportedModel`), before any weight is read.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.model import gptq
from worker.model.capability import UnsupportedModel, decoder_projections
from worker.model.quant_linear import Fp8Linear, QuantLinear, WeightScheme
from worker.model.small_batch import packed_bytes


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """FP8 E4M3 weights (per channel or per tensor); activations `none`, `token`
    (dynamic) or `static` (the checkpoint's `input_scale`)."""

    act: str = "none"


# model.quantization: quantize a float checkpoint's linear layers while loading it
AT_LOAD: dict[str, WeightScheme | Fp8Scheme | None] = {
    "none": None,
    "fp8": Fp8Scheme("token"),
    "w8a8_int8": WeightScheme(bits=8, act_int8=True),
    "int8": WeightScheme(bits=8),
    "int4": WeightScheme(bits=4, group_size=128),
}
_FORMATS = ("int-quantized", "pack-quantized", "naive-quantized", "float-quantized")
_FIELD = "config.quantization_config"


@dataclass(frozen=True, slots=True)
class CheckpointQuant:
    """A checkpoint's checked quantization: `method` (compressed-tensors, AWQ, GPTQ, MXFP4),
    its config in compressed-tensors' terms where it has one (`config`, and each config
    group's scheme in `schemes`), the converter of another format's layers, and the raw
    `quantization_config`."""

    config: object  # compressed_tensors.QuantizationConfig
    schemes: dict[str, WeightScheme | Fp8Scheme]
    # turns another format's tensors of one layer into compressed-tensors' (AutoAWQConverter)
    converter: object | None = None
    method: str = "compressed-tensors"
    raw: dict | None = None  # the checkpoint's quantization_config (GPTQ reads its fields per layer)

    def describe(self) -> str:
        """e.g. "compressed-tensors W8A8 (int8 weights, per-channel scales, ...)"."""
        kinds = sorted({s.describe() if isinstance(s, WeightScheme) else f"FP8 ({s.act} activations)"
                        for s in self.schemes.values()})
        return f"{self.method} {'; '.join(kinds)}"


def checkpoint_quant(hf_config, model_type: str) -> CheckpointQuant | None:
    """The checkpoint's quantization, checked; None when it has none.

    Raises:
        UnsupportedModel: a method, format or scheme not served (one line: what, and the field).
    """
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    raw = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(raw.get("quant_method", "?"))
    if method == "awq":
        return _awq(raw, model_type)
    if method == "mxfp4":  # GPT-OSS's experts: transformers' own dequantization at load
        return CheckpointQuant(None, {}, None, "MXFP4")
    if method == "gptq":
        return CheckpointQuant(None, {"gptq": gptq.scheme_of(raw, model_type)}, None, "GPTQ", raw)
    if method != "compressed-tensors":
        raise UnsupportedModel(model_type, f"weights quantized with {method!r}", f"{_FIELD}.quant_method",
                               "served: compressed-tensors integer and FP8 weights (W8A8, W8A16, W4A16, FP8), GPTQ, "
                               "AWQ (GEMM), MXFP4 (dequantized at load)")
    from compressed_tensors.quantization import QuantizationConfig

    try:
        parsed = QuantizationConfig.model_validate(
            {k: v for k, v in raw.items() if k not in ("sparsity_config", "transform_config")})
    except ValueError as e:
        raise UnsupportedModel(model_type, "an invalid compressed-tensors config", _FIELD, str(e)[:300]) from e
    for extra in ("sparsity_config", "transform_config"):
        if raw.get(extra):
            raise UnsupportedModel(model_type, f"compressed-tensors {extra.split('_')[0]}", f"{_FIELD}.{extra}")
    if parsed.kv_cache_scheme is not None:
        raise UnsupportedModel(model_type, "a quantized KV cache in the checkpoint", f"{_FIELD}.kv_cache_scheme")
    schemes = {}
    for name, group in parsed.config_groups.items():
        field = f"{_FIELD}.config_groups.{name}"
        fmt = getattr(group, "format", None) or parsed.format
        if fmt not in _FORMATS:
            raise UnsupportedModel(model_type, f"compressed-tensors format {fmt!r}", f"{field}.format",
                                   f"served: {', '.join(_FORMATS)}")
        schemes[name] = _scheme(group, field, model_type)
    return CheckpointQuant(parsed, schemes)


def load_kwargs(quant: CheckpointQuant | None, hf_config) -> dict:
    """`from_pretrained` keywords for a checkpoint quantized by `quant`: MXFP4 is
    dequantized by transformers while loading (`Mxfp4Config(dequantize=True)`: the format
    GPT-OSS ships its experts in; no FP4 kernel here); the others load with a config
    without `quantization_config`, their quantized layers then replaced by
    `install_checkpoint`."""
    if quant is None:
        return {}
    if quant.method == "MXFP4":
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    config = copy.deepcopy(hf_config)
    del config.quantization_config
    return {"config": config}


def _awq(raw: dict, model_type: str) -> CheckpointQuant:
    """An AutoAWQ checkpoint (4-bit GEMM packing, groups, zero points): compressed-tensors'
    `AutoAWQConverter` gives its config in compressed-tensors' terms and converts each
    layer's `qweight` / `qzeros` / `scales` as it is read."""
    from compressed_tensors.entrypoints.convert import AutoAWQConverter

    try:
        converter = AutoAWQConverter.from_autoawq_config(raw)
    except ValueError as e:
        field = "version" if raw.get("version", "gemm") != "gemm" else "bits"
        raise UnsupportedModel(model_type, f"an AWQ checkpoint ({e})", f"{_FIELD}.{field}",
                               "served: 4-bit GEMM") from e
    config = converter.update_config(None)
    schemes = {name: _scheme(group, f"{_FIELD} (AWQ)", model_type) for name, group in config.config_groups.items()}
    return CheckpointQuant(config, schemes, converter, "AWQ")


def _scheme(group, field: str, model_type: str) -> WeightScheme | Fp8Scheme:
    w, a = group.weights, group.input_activations

    def refuse(what: str, sub: str) -> UnsupportedModel:
        return UnsupportedModel(model_type, what, f"{field}.{sub}")

    if w is None:
        raise refuse("activation quantization without weight quantization", "weights")
    if group.output_activations is not None:
        raise refuse("quantized output activations", "output_activations")
    if str(w.type) == "float" and w.num_bits == 8:
        return _fp8_scheme(w, a, refuse)
    if str(w.type) != "int" or w.num_bits not in (4, 8):
        raise refuse(f"{w.num_bits}-bit {w.type} weights (served: int4, int8, fp8)", "weights")
    if str(w.strategy) not in ("channel", "group") or w.dynamic:
        raise refuse(f"weight scales by {w.strategy}{' (dynamic)' if w.dynamic else ''} "
                     "(served: channel, group)", "weights.strategy")
    if w.actorder is not None and str(w.actorder) not in ("weight", "static"):
        raise refuse(f"activation ordering {w.actorder!r} (a g_idx per input channel)", "weights.actorder")
    act_int8 = a is not None
    if act_int8 and not (str(a.type) == "int" and a.num_bits == 8 and str(a.strategy) == "token" and a.dynamic
                         and a.symmetric):
        raise refuse(f"{a.num_bits}-bit {a.type} activations by {a.strategy} (served: dynamic int8 per token)",
                     "input_activations")
    try:
        return WeightScheme(bits=w.num_bits, group_size=w.group_size if str(w.strategy) == "group" else None,
                            symmetric=w.symmetric, act_int8=act_int8)
    except ValueError as e:
        raise refuse(str(e), "weights") from e


def _fp8_scheme(w, a, refuse) -> Fp8Scheme:
    """FP8 weights per channel or per tensor; activations none, dynamic per token, or
    static per tensor. Block scales (DeepSeek-style `FP8_BLOCK`) and groups are refused."""
    if str(w.strategy) not in ("channel", "tensor") or w.dynamic:
        raise refuse(f"FP8 weight scales by {w.strategy} (served: channel, tensor)", "weights.strategy")
    if a is None:
        return Fp8Scheme("none")
    if str(a.type) != "float" or a.num_bits != 8:
        raise refuse(f"{a.num_bits}-bit {a.type} activations with FP8 weights", "input_activations")
    if str(a.strategy) == "token" and a.dynamic:
        return Fp8Scheme("token")
    if str(a.strategy) == "tensor" and not a.dynamic:
        return Fp8Scheme("static")
    raise refuse(f"FP8 activations by {a.strategy}{' (dynamic)' if a.dynamic else ''} "
                 "(served: dynamic per token, static per tensor)", "input_activations.strategy")


def install_checkpoint(model: torch.nn.Module, path: Path, quant: CheckpointQuant) -> int:
    """Replace each layer the checkpoint quantized (`quant`'s config groups' targets; for
    GPTQ, every linear layer with a `qweight`) with a `QuantLinear` or `Fp8Linear` holding
    its values (read from `path`'s safetensors files). Returns the number of layers
    replaced.

    Raises:
        UnsupportedModel: a targeted module is not a linear layer, or its tensors are missing.
    """
    from compressed_tensors.utils import match_named_modules

    model_type = str(getattr(model.config, "model_type", "?"))
    replaced = 0
    with _Tensors(path) as tensors:
        if quant.method == "GPTQ":  # every linear layer whose packed weight the checkpoint holds
            for mod_name, mod in list(model.named_modules()):
                if isinstance(mod, torch.nn.Linear) and tensors.has(f"{mod_name}.qweight"):
                    layer = gptq.read_layer(tensors, mod_name, mod, quant.schemes["gptq"], quant.raw, model_type)
                    _replace(model, mod_name, layer)
                    replaced += 1
            return replaced
        for name, group in quant.config.config_groups.items():
            scheme = quant.schemes[name]
            for mod_name, mod in list(match_named_modules(model, group.targets, quant.config.ignore)):
                if not isinstance(mod, torch.nn.Linear):
                    raise UnsupportedModel(model_type, f"a quantized {type(mod).__name__} ({mod_name})",
                                           f"{_FIELD}.config_groups.{name}.targets")
                local = _layer_tensors(tensors, mod_name, quant.converter)
                dev = mod.weight.device
                if isinstance(scheme, Fp8Scheme):
                    layer = _fp8_layer(local, mod_name, mod, scheme, model_type)
                else:
                    q, scale, zero = _read_layer(local, mod_name, mod, scheme, model_type)
                    layer = QuantLinear(mod.in_features, mod.out_features, scheme, q.to(dev), scale.to(dev),
                                        None if zero is None else zero.to(dev), mod.bias)
                _replace(model, mod_name, layer)
                replaced += 1
    return replaced


def _layer_tensors(tensors: _Tensors, name: str, converter) -> dict[str, torch.Tensor]:
    """The layer's tensors in compressed-tensors' names (`weight`, `weight_packed`,
    `weight_scale`, `weight_zero_point`), converted from another format by `converter`."""
    suffixes = ("qweight", "qzeros", "scales") if converter is not None else (
        "weight", "weight_packed", "weight_scale", "weight_zero_point", "input_scale")
    local = {f"{name}.{s}": tensors.get(f"{name}.{s}") for s in suffixes if tensors.has(f"{name}.{s}")}
    if converter is not None and local:
        local = converter.process(local)
    return {key.removeprefix(f"{name}."): t for key, t in local.items()}


def _read_layer(local: dict[str, torch.Tensor], name: str, mod: torch.nn.Linear, scheme: WeightScheme,
                model_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The layer's int8 `[out, in]` values, float32 scale `[out, groups]` and zero point,
    from its tensors in compressed-tensors' names."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    n, k = mod.out_features, mod.in_features
    groups = k // (scheme.group_size or k)
    if "weight_packed" in local:
        q = unpack_from_int32(local["weight_packed"], scheme.bits, torch.Size([n, k]), packed_dim=1)
    elif "weight" in local:
        q = local["weight"]
    else:
        raise UnsupportedModel(model_type, f"no quantized weight for {name}", f"{name}.weight_packed")
    scale = local["weight_scale"].float().reshape(n, groups)
    zero = None
    if not scheme.symmetric:
        zp = local["weight_zero_point"]
        if zp.dtype == torch.int32 and zp.shape[0] != n:  # packed along the output channels
            zp = unpack_from_int32(zp, scheme.bits, torch.Size([n, groups]), packed_dim=0)
        zero = zp.reshape(n, groups)
    q = q.to(torch.float32) if q.is_floating_point() else q
    return q.round().to(torch.int8).reshape(n, k), scale, zero


def _fp8_layer(local: dict[str, torch.Tensor], name: str, mod: torch.nn.Linear, scheme: Fp8Scheme,
               model_type: str) -> Fp8Linear:
    if "weight" not in local or local["weight"].dtype != torch.float8_e4m3fn:
        raise UnsupportedModel(model_type, f"no FP8 E4M3 weight for {name}", f"{name}.weight")
    dev = mod.weight.device
    input_scale = local.get("input_scale") if scheme.act == "static" else None
    return Fp8Linear(mod.in_features, mod.out_features, local["weight"].to(dev), local["weight_scale"].to(dev),
                     scheme.act, None if input_scale is None else input_scale.to(dev), mod.bias,
                     dtype=mod.weight.dtype)


def _replace(model: torch.nn.Module, name: str, layer: torch.nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, layer)


class _Tensors(contextlib.AbstractContextManager):
    """Read-only view of a checkpoint's tensors by name, over one or many safetensors files."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = dict(json.loads(index.read_text())["weight_map"])
        else:
            from safetensors import safe_open

            with safe_open(path / "model.safetensors", "pt") as f:
                files = dict.fromkeys(f.keys(), "model.safetensors")
        self._path, self._files, self._open = path, files, {}
        self._stack = contextlib.ExitStack()

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        fname = self._files[name]
        if fname not in self._open:
            self._open[fname] = self._stack.enter_context(safe_open(self._path / fname, "pt"))
        return self._open[fname].get_tensor(name)

    def __exit__(self, *exc) -> None:
        self._stack.close()


def quantize_at_load(model: torch.nn.Module, method: str) -> int:
    """Quantize the float linear layers of the decoder layers (not the output embedding,
    not MoE experts, not layers outside the decoder stack, not MLA's `kv_b_proj`, which
    the latent KV cache reads as a float matrix: `worker.model.latent`) by
    `AT_LOAD[method]`, in place. A layer whose input width the scheme's group size does
    not divide keeps per-channel scales; `fp8` is FP8-dynamic (E4M3 per output channel,
    activations per token). Returns the number of layers replaced."""
    scheme = AT_LOAD[method]
    if scheme is None:
        return 0
    replaced = 0
    layers = decoder_projections(model, (torch.nn.Linear,))
    for name, mod in layers.items():
        if name.endswith("kv_b_proj"):
            continue
        if isinstance(scheme, Fp8Scheme):
            layer = Fp8Linear.quantize(mod, scheme.act)
        else:
            s = scheme
            if s.group_size and mod.in_features % s.group_size:
                s = WeightScheme(bits=s.bits, symmetric=s.symmetric)
            layer = QuantLinear.quantize(mod, s)
        _replace(model, name, layer)
        replaced += 1
    return replaced


def describe_layers(model: torch.nn.Module) -> list[str]:
    """One line per scheme in use: "W4A16 (int4 weights, groups of 128, symmetric) on 84 layers"."""
    counts = Counter(m.describe() for m in model.modules() if isinstance(m, QuantLinear | Fp8Linear))
    return [f"{kind} on {n} layers" for kind, n in sorted(counts.items())]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer and of the oneDNN-packed weights
    (`small_batch.packed_bytes`): the weights' resident size."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) + packed_bytes(model)
