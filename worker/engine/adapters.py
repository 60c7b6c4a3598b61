"""LoRA adapters on disk: which names exist under `model.lora_dir`, and whether one can be
served on this base model. No torch: the checks read `adapter_config.json` and the
safetensors header (tensor names, shapes, dtypes), never the weights, so input
processing (the worker's tokenizer threads) runs them before a job reaches the engine.

Format: PEFT's (`peft.PeftModel.save_pretrained`), one subdirectory per adapter name:

    <lora_dir>/<name>/adapter_config.json        peft_type LORA, r, lora_alpha, ...
    <lora_dir>/<name>/adapter_model.safetensors  base_model.model.<module>.lora_A.weight [r, in]
                                                 base_model.model.<module>.lora_B.weight [out, r]

Served: LoRA on the linear projections of the decoder layers (attention and dense MLP),
per-module ranks and alphas (`rank_pattern`, `alpha_pattern`), rsLoRA scaling. Refused
as `invalid_adapter`, with the reason: DoRA, trained biases, `modules_to_save`, embedding
or lm_head LoRA, `fan_in_fan_out`, pickle weights (`adapter_model.bin`: never unpickled),
a module this model does not have or whose shape differs (an adapter made for another
base model), a rank above `model.max_lora_rank`.

Writer: an `AdapterCatalog` caches what it checked, keyed by the files' mtimes (an
adapter replaced on disk is checked again); any thread may call it (a lock).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from schemas.wire import ADAPTER_PATTERN

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_NAME = re.compile(ADAPTER_PATTERN.strip("^$"))
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")
MAX_HEADER_BYTES = 64 * 1024 * 1024
log = logging.getLogger(__name__)


class LoRAFacts(msgspec.Struct, frozen=True, array_like=True):
    """What input processing needs to check adapters: `model.lora_dir`,
    `model.max_lora_rank`, and the model's LoRA-capable projections: name ->
    (in_features, out_features)."""

    lora_dir: str
    max_rank: int
    modules: dict[str, tuple[int, int]]


def adapter_version(path: str) -> tuple[float, float]:
    """Which version of the adapter in directory `path` is on disk: the mtimes of its
    config and weights (an adapter replaced on disk is a new version). Raises
    FileNotFoundError when either is missing."""
    return os.stat(os.path.join(path, CONFIG_FILE)).st_mtime, os.stat(os.path.join(path, WEIGHTS_FILE)).st_mtime


class AdapterError(Exception):
    """An adapter that cannot be served. `code`: `unknown_adapter` (no such directory)
    or `invalid_adapter` (the message says why)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One checked adapter.

    `modules`: module name (as in the transformers model, e.g.
    `model.layers.0.self_attn.q_proj`) -> (rank, scale) where the delta is
    `scale * B @ A @ x`; `rank`: the largest; `num_params`: elements of all A and B.
    """

    name: str
    path: str
    modules: dict[str, tuple[int, float]]
    rank: int
    num_params: int
    dtype: str
    version: tuple[float, float]  # mtimes of the config and the weights


def validate_name(name: str) -> str:
    """`name`, or AdapterError(unknown_adapter) if it cannot be a directory name here
    (letters, digits, `.`, `_`, `-`; no path separators; at most 128 characters)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise AdapterError("unknown_adapter", f"adapter name {name!r} is not a valid adapter name "
                                              "(letters, digits, '.', '_', '-'; at most 128)")
    return name


def safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets}.

    Raises:
        AdapterError(invalid_adapter): not a safetensors file.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise AdapterError("invalid_adapter", f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


class AdapterCatalog:
    """The LoRA adapters under `model.lora_dir`, each checked once (config and safetensors header) and cached until its files change.

    Args:
        lora_dir: the adapters' directory (`model.lora_dir`).
        max_rank: `model.max_lora_rank`.
        modules: the base model's LoRA-capable linear modules: name -> (in_features,
            out_features) (`worker.model.lora.lora_modules`).
    """

    @classmethod
    def from_facts(cls, facts: LoRAFacts) -> AdapterCatalog:
        return cls(facts.lora_dir, facts.max_rank, facts.modules)

    def __init__(self, lora_dir: str, max_rank: int, modules: Mapping[str, tuple[int, int]]) -> None:
        self.lora_dir = lora_dir
        self.max_rank = max_rank
        self.modules = dict(modules)
        self._specs: dict[str, AdapterSpec] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """Adapter names present now (subdirectories holding an adapter_config.json)."""
        try:
            entries = sorted(os.listdir(self.lora_dir))
        except OSError:
            return []
        return [n for n in entries if _NAME.fullmatch(n) and os.path.isfile(os.path.join(self.lora_dir, n, CONFIG_FILE))]

    def scan(self) -> dict[str, str | None]:
        """Check every adapter present now (at the engine's start): name -> None when it
        can be served, else why not. Logged: one line for all, one per invalid adapter."""
        verdicts: dict[str, str | None] = {}
        for name in self.names():
            try:
                self.resolve(name)
                verdicts[name] = None
            except AdapterError as e:
                verdicts[name] = e.message
                log.warning("LoRA adapter cannot be served (%s): %s", e.code, e.message)
        ok = [n for n, why in verdicts.items() if why is None]
        log.info("LoRA adapters in %s: %d servable%s, %d not", self.lora_dir, len(ok),
                 f" ({', '.join(ok[:20])}{', ...' if len(ok) > 20 else ''})" if ok else "", len(verdicts) - len(ok))
        return verdicts

    def resolve(self, name: str) -> AdapterSpec:
        """The checked spec of adapter `name` (cached until its files change).

        Raises:
            AdapterError: `unknown_adapter` (no such adapter) or `invalid_adapter`.
        """
        validate_name(name)
        path = os.path.join(self.lora_dir, name)
        config_path = os.path.join(path, CONFIG_FILE)
        try:
            version = adapter_version(path)
        except FileNotFoundError:
            if not os.path.isfile(config_path):
                raise AdapterError("unknown_adapter", f"no adapter {name!r} in {self.lora_dir} "
                                                      f"(known: {', '.join(self.names()[:20]) or 'none'})") from None
            bin_only = os.path.isfile(os.path.join(path, "adapter_model.bin"))
            raise AdapterError("invalid_adapter", f"adapter {name!r} has no {WEIGHTS_FILE}" + (
                " (adapter_model.bin is pickle and never loaded: save with safe_serialization=True)"
                if bin_only else "")) from None
        with self._lock:
            spec = self._specs.get(name)
            if spec is not None and spec.version == version:
                return spec
        spec = self._check(name, path, version)
        with self._lock:
            self._specs[name] = spec
        return spec

    def _check(self, name: str, path: str, version: tuple[float, float]) -> AdapterSpec:
        def invalid(why: str) -> AdapterError:
            return AdapterError("invalid_adapter", f"adapter {name!r}: {why}")

        try:
            with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise invalid(f"unreadable {CONFIG_FILE} ({e})") from None
        if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
            raise invalid(f"peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r} is not LORA")
        for key, why in (("use_dora", "DoRA"), ("lora_bias", "trained LoRA biases"), ("fan_in_fan_out", "fan_in_fan_out"),
                         ("modules_to_save", "modules_to_save (whole layers replaced)"),
                         ("layer_replication", "layer_replication"), ("trainable_token_indices", "trainable tokens")):
            if cfg.get(key):
                raise invalid(f"{why} is not served")
        if cfg.get("bias", "none") != "none":
            raise invalid(f"bias={cfg['bias']!r} (trained biases) is not served")
        alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
        alpha_pattern = cfg.get("alpha_pattern") or {}
        rslora = bool(cfg.get("use_rslora"))
        header = safetensors_header(os.path.join(path, WEIGHTS_FILE))
        shapes: dict[str, dict[str, list[int]]] = {}
        dtypes = set()
        for key, info in header.items():
            m = _KEY.fullmatch(key)
            if m is None:
                raise invalid(f"tensor {key!r} is not a LoRA A/B weight of a linear layer (embedding or "
                              "lm_head LoRA, DoRA magnitudes, saved modules are not served)")
            shapes.setdefault(m["module"], {})[m["ab"]] = info["shape"]
            dtypes.add(info["dtype"])
        if not shapes:
            raise invalid(f"{WEIGHTS_FILE} holds no LoRA weights")
        modules: dict[str, tuple[int, float]] = {}
        num_params = 0
        for module, ab in sorted(shapes.items()):
            if module not in self.modules:
                base = cfg.get("base_model_name_or_path")
                raise invalid(absent_module_reason(module, self.modules)
                              + (f" (the adapter names base model {base!r})" if base else ""))
            if set(ab) != {"A", "B"}:
                raise invalid(f"module {module!r} has lora_{'A' if 'A' in ab else 'B'} without its pair")
            (r, n_in), (n_out, r_b) = ab["A"], ab["B"]
            want_in, want_out = self.modules[module]
            if (n_in, n_out) != (want_in, want_out) or r != r_b:
                raise invalid(f"module {module!r}: A {ab['A']} / B {ab['B']} do not fit its {want_in} -> {want_out} "
                              "features (an adapter made for another base model)")
            if r > self.max_rank:
                raise invalid(f"rank {r} of module {module!r} is above model.max_lora_rank ({self.max_rank})")
            a = float(_pattern_value(alpha_pattern, module, alpha))
            modules[module] = (r, a / math.sqrt(r) if rslora else a / r)
            num_params += r * (n_in + n_out)
        return AdapterSpec(name, path, modules, max(r for r, _ in modules.values()), num_params,
                           "/".join(sorted(dtypes)), version)


_LAYER = re.compile(r"(?P<stack>.*\.layers)\.(?P<index>\d+)\.(?P<rest>.+)")


def absent_module_reason(module: str, modules: Mapping[str, object]) -> str:
    """Why adapter module `module` is not among this model's LoRA targets `modules`
    (their names), as the first concrete mismatch: a layer index beyond the model's
    layers, a projection its layers do not have (listing theirs), an MoE expert, or a
    module outside the decoder layers."""
    m = _LAYER.fullmatch(module)
    if m is None:
        return f"module {module!r} is not in this model's decoder layers (LoRA targets their linear projections)"
    layers = [_LAYER.fullmatch(n) for n in modules]
    ours = {int(x["index"]) for x in layers if x is not None and x["stack"] == m["stack"]}
    if not ours:
        return f"module {module!r}: this model has no layer stack {m['stack']!r}"
    index = int(m["index"])
    if index not in ours:
        return f"module {module!r}: layer {index} is beyond this model's {max(ours) + 1} decoder layers"
    if ".experts." in f".{m['rest']}":
        return f"module {module!r} is an MoE expert (experts see a subset of the tokens: not served)"
    rests = sorted({x["rest"] for x in layers if x is not None and x["stack"] == m["stack"] and int(x["index"]) == index})
    return f"module {module!r}: layer {index} of this model has no {m['rest']!r} (its projections: {', '.join(rests)})"


def _pattern_value(pattern: Mapping[str, float], module: str, default: float) -> float:
    """PEFT's `alpha_pattern` lookup: the first key that matches the end of the module's
    name (a regex, as PEFT matches it)."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
