"""Load a local Hugging Face checkpoint (any decoder-only transformers model whose
attention goes through transformers' attention interface) with our paged attention."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from worker.config import ModelConfig
from worker.model.attention import ATTN_IMPLEMENTATION


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    model_id: str


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


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load model + tokenizer from `cfg.path` (offline; nothing is downloaded).

    Raises:
        FileNotFoundError: `cfg.path` is not a directory with a config.json.
        ValueError: the architecture uses features the paged attention does not support.
    """
    path = Path(cfg.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path {str(path)!r} is not a Hugging Face checkpoint directory (no config.json)")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(f"{hf_config.model_type} is an encoder-decoder model; only decoder-only models are supported")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True
    )
    model.to(device).eval()
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

    max_len = cfg.max_model_len or getattr(text_cfg, "max_position_embeddings", None) or 2048
    window = getattr(text_cfg, "sliding_window", None)
    if window and getattr(text_cfg, "use_sliding_window", True) and window < max_len:
        max_len = window  # never exceed the window, so full attention is exact
    num_heads = text_cfg.num_attention_heads
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // num_heads
    num_kv_heads = getattr(text_cfg, "num_key_value_heads", None) or num_heads

    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(path, hf_config, tokenizer),
        max_model_len=int(max_len),
        num_layers=text_cfg.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=text_cfg.vocab_size,
        device=device,
        dtype=dtype,
        model_id=f"{text_cfg.model_type}:{path.resolve()}",
    )
