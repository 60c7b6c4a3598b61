"""Load a local Hugging Face checkpoint with our paged attention, and decide at load
whether the engine reproduces it (`worker.model.capability`, `worker.model.load_check`):
a model the paged runner cannot run exactly is refused here, never per request."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from worker.config import ConfigError, ModelConfig
from worker.model import latent, legacy, quant_load, recurrent, small_batch
from worker.model.attention import ATTN_IMPLEMENTATION
from worker.model.capability import KVLayout, UnsupportedModel, check_config, check_modules
from worker.model.kernels import get_backend
from worker.model.recurrent import StateLayout

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    """A model ready for the engine.

    `kv_layout` is each layer's KV shape as measured by the load check; `features` names
    what the model needs beyond plain causal attention (for `inflight check` and logs);
    `load_check_error` the largest relative logit difference the load check saw (None:
    not run); `state_layout` the recurrent mixers' per-request states (empty: none;
    `worker.model.recurrent`).
    """

    model: torch.nn.Module | None
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_model_len: int
    kv_layout: KVLayout
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    model_id: str
    backend: ModuleType | None = None
    features: tuple[str, ...] = ()
    load_check_error: float | None = None
    state_layout: StateLayout = StateLayout()

    @property
    def num_layers(self) -> int:
        return self.kv_layout.num_layers

    def verdict(self) -> str:
        """One line: what the engine runs of this model, and how it was checked."""
        kinds = ", ".join(self.features) or "full causal attention"
        check = ("load check not run" if self.load_check_error is None
                 else f"load check: logits within {self.load_check_error:.1g} x std of transformers' eager attention")
        return f"supported ({kinds}); {check}"


def resolve_device(name: str) -> torch.device:
    """Raises:
    ValueError: a CUDA device is asked for where there is none (or not that many)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"model.device is {name!r} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                         "use 'auto' or 'cpu'")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def eos_token_ids(path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id that ends generation: the union of `eos_token_id` in generation_config.json
    (if present), in the model config (config.json) and in its text config (composite
    models such as Llava keep it there), and the tokenizer's EOS. Each source may give
    an int, a list of ints, or nothing. transformers' `generate` uses the generation
    config, which defaults to the model config's ids when the file is missing; the
    union also covers checkpoints whose sources disagree."""

    def ids(value: int | list[int] | None) -> set[int]:
        if value is None:
            return set()
        return {int(value)} if isinstance(value, int) else {int(v) for v in value}

    eos: set[int] = set()
    if (path / "generation_config.json").is_file():
        eos |= ids(GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id)
    eos |= ids(getattr(hf_config, "eos_token_id", None))
    if hasattr(hf_config, "get_text_config"):
        eos |= ids(getattr(hf_config.get_text_config(), "eos_token_id", None))
    eos |= ids(tokenizer.eos_token_id)
    return frozenset(eos)


def check_readable(path: Path) -> None:
    """Every file of the checkpoint directory readable by this process: safetensors reports
    an unreadable weights file as "No such file or directory", which sends an operator
    looking for a missing file (seen with a 0600 model.safetensors mounted into a
    container that runs as another user).

    Raises:
        PermissionError: the files (mode, owner) and this process's uid, with the fix.
    """
    unreadable = [f for f in sorted(path.iterdir()) if f.is_file() and not os.access(f, os.R_OK)]
    if unreadable:
        st = unreadable[0].stat()
        names = ", ".join(f.name for f in unreadable[:5]) + (" ..." if len(unreadable) > 5 else "")
        raise PermissionError(
            f"model.path {str(path)!r}: not readable by this process (uid {os.getuid()}): {names} "
            f"(mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}); make the checkpoint world-readable "
            f"(chmod -R a+rX) or run the worker as its owner")


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load model + tokenizer from `cfg.path` (offline; nothing is downloaded), install
    it for the engine and run the load check.

    Raises:
        FileNotFoundError: `cfg.path` is not a directory with a config.json.
        PermissionError: files of the checkpoint this process may not read.
        UnsupportedModel: the engine cannot reproduce this model (one line: architecture,
            feature, config field), quantization schemes included
            (`worker.model.quant_load`); a subclass of ValueError.
        ConfigError: `cfg.quantization` asks to quantize a checkpoint that is quantized.
        ValueError: device or back end not available.
    """
    path = Path(cfg.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path {str(path)!r} is not a Hugging Face checkpoint directory (no config.json)")
    check_readable(path)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    backend = get_backend(cfg.attention_backend, device.type)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    text_cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    model_type = str(getattr(text_cfg, "model_type", None) or hf_config.model_type)
    check_config(text_cfg, model_type)
    quant = quant_load.checkpoint_quant(hf_config, model_type)
    if quant is not None and cfg.quantization != "none":
        raise ConfigError(f"model.quantization is {cfg.quantization!r} but the checkpoint is already quantized "
                          f"({quant.describe()}); set it to 'none'")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = _from_pretrained(path, dtype, model_type, quant_load.load_kwargs(quant, hf_config))
    model.to(device).eval()
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    check_modules(model, model_type)
    features = _quantize(model, path, quant, cfg.quantization)
    features += legacy.install(model)
    try:
        latents = latent.install(model)
    except ValueError as e:
        raise UnsupportedModel(model_type, "latent attention with a non-linear up-projection", "kv_b_proj", str(e)) from e
    mixers = recurrent.install(model)
    small_batch.install(model, policy=cfg.cpu_linear)  # a kernel choice, as the attention back end is: not a feature of the model
    layout, call_features, states = _measure(model, text_cfg, model_type, backend)
    features += call_features
    if mixers:
        kinds = sorted({type(m).__name__ for m in mixers.values()})
        continues = recurrent.probe_continuation(model, states, text_cfg.hidden_size)
        features.append(f"recurrent state in {len(mixers)} layers ({', '.join(kinds)}; "
                        f"{states.bytes_per_request} bytes per request; chunks continue "
                        f"{'by the sequence path' if all(continues.values()) else 'token by token'})")
    if latents:
        r = next(iter(latents.values()))
        features.append(f"latent KV cache ({r.latent_dim} values per token per layer)")
    error = None
    if cfg.load_check:
        from worker.model.load_check import compare_with_reference

        error = compare_with_reference(model, layout, backend, model_type, text_cfg.vocab_size, states=states)
    max_len = cfg.max_model_len or getattr(text_cfg, "max_position_embeddings", None) or 2048
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(path, hf_config, tokenizer),
        max_model_len=int(max_len),
        kv_layout=layout,
        vocab_size=text_cfg.vocab_size,
        device=device,
        dtype=dtype,
        model_id=f"{text_cfg.model_type}:{path.resolve()}",
        backend=backend,
        features=tuple(features),
        load_check_error=error,
        state_layout=states,
    )
    log.info("model %s: %s", model_type, loaded.verdict())
    return loaded


def _quantize(model: torch.nn.Module, path: Path, quant: quant_load.CheckpointQuant | None,
              method: str) -> list[str]:
    """The checkpoint's quantized layers installed, or the float ones quantized by `method`;
    the feature line for `inflight check` and the log."""
    if quant is not None and quant.method == "MXFP4":
        return ["MXFP4 experts dequantized at load by transformers (float memory)"]
    if quant is not None:
        quant_load.install_checkpoint(model, path, quant)
        return [f"{quant.method} {line}" for line in quant_load.describe_layers(model)]
    quant_load.quantize_at_load(model, method)
    return [f"{line}, quantized at load" for line in quant_load.describe_layers(model)]


def _from_pretrained(path: Path, dtype: torch.dtype, model_type: str, kwargs: dict | None = None) -> torch.nn.Module:
    """With our attention implementation; a model that picks its attention classes from
    the implementation's name at construction (Falcon) is built with `eager` and switched
    by its adapter (`worker.model.legacy`).

    `kwargs`: `from_pretrained` keywords for a quantized checkpoint (`quant_load.load_kwargs`:
    a config without its `quantization_config`, whose quantized layers
    `quant_load.install_checkpoint` replaces; transformers' report of the keys it did not
    load is then kept out of the log).

    Raises:
        UnsupportedModel: neither works.
    """
    kwargs = kwargs or {}
    with _quiet_load_report("config" in kwargs):
        try:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                                        local_files_only=True, **kwargs)
        except KeyError as e:
            if ATTN_IMPLEMENTATION not in str(e) or not legacy.has_adapter(model_type):
                raise UnsupportedModel(model_type, "attention classes chosen by implementation name",
                                       "config._attn_implementation",
                                       f"transformers: {type(e).__name__}: {e}") from e
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                     local_files_only=True, **kwargs)
    legacy.use_paged_attention(model)
    return model


@contextlib.contextmanager
def _quiet_load_report(on: bool) -> Iterator[None]:
    """transformers logs a table of a checkpoint's missing and unexpected keys; for a
    quantized checkpoint loaded as float, every quantized layer is in it, by design."""
    if not on:
        yield
        return
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _measure(model: torch.nn.Module, text_cfg, model_type: str,
             backend: ModuleType) -> tuple[KVLayout, list[str], StateLayout]:
    """The load check's shape pass: the KV layout, the attention features in use, and
    the recurrent mixers' states."""
    from worker.model.load_check import measure_layers

    trace, states = measure_layers(model, text_cfg, model_type, backend)
    layers = tuple(trace[i].kv if i in trace else None for i in range(max(trace, default=-1) + 1))
    windows = [call.params.sliding_window for call in trace.values()]
    all_windowed = all(w is not None for w in windows)  # then blocks behind the largest window are dead
    features = []
    n_sliding = sum(1 for w in windows if w is not None)
    if n_sliding:
        sizes = sorted({w for w in windows if w is not None})
        features.append(f"sliding window {'/'.join(map(str, sizes))} on {n_sliding} of {len(windows)} layers")
    if any(c.params.softcap is not None for c in trace.values()):
        features.append("attention logit soft-capping")
    if any(c.params.sinks is not None for c in trace.values()):
        features.append("attention sinks")
    if any(c.params.alibi_slopes is not None for c in trace.values()):
        features.append("ALiBi")
    if getattr(text_cfg, "final_logit_softcapping", None):
        features.append("final logit soft-capping (in the model)")
    window = max(windows) if all_windowed and windows else None
    return KVLayout(layers, sliding_window=window), features, states
