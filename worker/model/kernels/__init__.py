"""Attention back ends. Each provides `write_kv` and `paged_attention` with the contract
documented in `torch_ref.py`; `get_backend(name, device)` picks one."""

from __future__ import annotations

from types import ModuleType


def get_backend(name: str, device_type: str) -> ModuleType:
    """Return the attention back end module.

    Args:
        name: `auto` (Triton on CUDA, torch elsewhere), `torch`, or `triton`.
        device_type: `cuda` or `cpu`.

    Raises:
        ValueError: unknown name, or `triton` requested where Triton cannot run.
    """
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name == "torch":
        from worker.model.kernels import torch_ref

        return torch_ref
    if name == "triton":
        raise ValueError(
            "model.attention_backend='triton' is not available in this build yet; allowed: ['auto', 'torch']"
        )
    raise ValueError(f"model.attention_backend must be one of ['auto', 'torch', 'triton'], got {name!r}")
