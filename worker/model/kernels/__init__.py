"""Attention back ends. Each provides `write_kv` and `paged_attention` with the contract
documented in `torch_ref.py`; `get_backend(name, device)` picks one.

    torch_ref.py     plain torch (the reference)
    cpu_attn.py      the reference with decodes in a C kernel built at first use (CPU default
                     where a C compiler builds it; else the reference)
    triton_attn.py   Triton kernels (CUDA default; on CPU only under TRITON_INTERPRET=1)
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

log = logging.getLogger(__name__)


def get_backend(name: str, device_type: str) -> ModuleType:
    """Return the attention back end module.

    Args:
        name: `auto` (Triton on CUDA; on the CPU `cpu` when its kernel builds, else
            `torch`), `torch`, `cpu`, or `triton`.
        device_type: `cuda` or `cpu`.

    Raises:
        ValueError: unknown name, `triton` requested where Triton cannot run, or `cpu`
            requested where its kernel cannot be built.
    """
    if name == "auto":
        if device_type == "cuda":
            name = "triton"
        else:
            from worker.model.kernels import cpu_attn

            name = "cpu" if cpu_attn.available() else "torch"
            if name == "torch":
                log.warning("attention: the CPU decode kernel is unavailable (%s); using the torch reference",
                            cpu_attn.unavailable_reason())
    if name == "cpu":
        from worker.model.kernels import cpu_attn

        if device_type != "cpu":
            raise ValueError(f"model.attention_backend='cpu' runs on the CPU, not on {device_type}")
        if not cpu_attn.available():
            raise ValueError(f"model.attention_backend='cpu': its kernel cannot be built "
                             f"({cpu_attn.unavailable_reason()}); use 'torch' or 'auto'")
        return cpu_attn
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
    raise ValueError(f"model.attention_backend must be one of ['auto', 'torch', 'cpu', 'triton'], got {name!r}")
