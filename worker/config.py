"""Configuration Structs and their validation.

Every setting is a typed `msgspec.Struct` field. Values are checked in
`__post_init__`, and errors name the field and the allowed values, e.g.
`serving_tuning.kv_policy must be one of ['optimistic', 'reserve'], got 'greedy'`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

KV_POLICIES = ("optimistic", "reserve")
OVERLOAD_POLICIES = ("queue_or_reject", "reject")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _positive(section: str, **fields: int | None) -> None:
    for name, value in fields.items():
        if value is not None and value < 1:
            raise ConfigError(f"{section}.{name} must be >= 1, got {value}")


def _one_of(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{name} must be one of {sorted(allowed)}, got {value!r}")


class ServingTuning(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Capacity limits of one engine (DESIGN §5), in the vocabulary of TGI / TensorRT-LLM.

    Attributes:
        max_running_requests: most requests in the running batch at once.
        max_total_tokens: KV cache capacity in tokens (rounded down to whole blocks).
            None: derived from free GPU memory on CUDA, 16384 on CPU.
        max_input_tokens: longest prompt accepted, in tokens.
        max_output_tokens: most tokens one request may generate (default for
            requests without `max_tokens`, and an upper bound for those with it).
        max_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        admission_control: reject at once requests that can never fit.
        overload_policy: `queue_or_reject` queues what fits later; `reject` also
            rejects requests that cannot start now (used by the worker).
        kv_policy: `optimistic` admits when the prompt fits and preempts by recompute
            when blocks run out (vLLM); `reserve` admits only when prompt + max_tokens
            fit and never evicts (TensorRT-LLM GUARANTEED_NO_EVICT, TGI).
        kv_block_size: tokens per KV block.
        enable_prefix_caching: share full KV blocks between equal prefixes.
        priority_aging_steps: a waiting request gains one priority class per this
            many engine steps, so low priority never starves.
        gpu_memory_utilization: fraction of free GPU memory given to the KV cache
            when `max_total_tokens` is unset.
    """

    max_running_requests: int = 64
    max_total_tokens: int | None = None
    max_input_tokens: int = 8192
    max_output_tokens: int = 1024
    max_batched_tokens: int = 2048
    admission_control: bool = True
    overload_policy: Literal["queue_or_reject", "reject"] = "queue_or_reject"
    kv_policy: Literal["optimistic", "reserve"] = "optimistic"
    kv_block_size: int = 16
    enable_prefix_caching: bool = True
    priority_aging_steps: int = 512
    gpu_memory_utilization: float = 0.85

    def __post_init__(self) -> None:
        _positive(
            "serving_tuning",
            max_running_requests=self.max_running_requests,
            max_total_tokens=self.max_total_tokens,
            max_input_tokens=self.max_input_tokens,
            max_output_tokens=self.max_output_tokens,
            max_batched_tokens=self.max_batched_tokens,
            kv_block_size=self.kv_block_size,
            priority_aging_steps=self.priority_aging_steps,
        )
        _one_of("serving_tuning", "kv_policy", self.kv_policy, KV_POLICIES)
        _one_of("serving_tuning", "overload_policy", self.overload_policy, OVERLOAD_POLICIES)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"serving_tuning.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < self.kv_block_size:
            raise ConfigError(
                f"serving_tuning.max_total_tokens ({self.max_total_tokens}) must hold at least one "
                f"KV block of kv_block_size={self.kv_block_size} tokens"
            )


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which checkpoint to load and where.

    Attributes:
        path: local Hugging Face checkpoint directory (config.json, weights, tokenizer).
        dtype: `auto` = bfloat16 on CUDA, float32 on CPU.
        device: `auto` = cuda if available, else cpu.
        attention_backend: `auto` = Triton on CUDA, the torch reference on CPU.
        max_model_len: context length; None = the model config's
            `max_position_embeddings` (capped by a sliding window if the model has one).
    """

    path: str = ""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _one_of("model", "dtype", self.dtype, DTYPES)
        _one_of("model", "attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _positive("model", max_model_len=self.max_model_len)


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything the engine needs: the model and its capacity limits."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    serving_tuning: ServingTuning = msgspec.field(default_factory=ServingTuning)
