"""Attention back ends. Each provides `write_kv` and `paged_attention` with the contract
documented in `torch_ref.py`; `get_backend(name, device)` picks one.

    torch_ref.py     plain torch (CPU default; the reference)
    triton_attn.py   Triton kernels (CUDA default; on CPU only under TRITON_INTERPRET=1)
"""

from __future__ import annotations

import os
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
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "model.attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 for debugging on the "
                "CPU); use 'auto' or 'torch' here"
            )
        try:
            from worker.model.kernels import triton_attn
        except ImportError as e:
            raise ValueError(f"model.attention_backend='triton' needs the triton package: {e}") from e
        return triton_attn
    raise ValueError(f"model.attention_backend must be one of ['auto', 'torch', 'triton'], got {name!r}")
