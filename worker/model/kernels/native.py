"""The torch operators written in C++ (`native_ops.cpp`): the per-call side of the CPU
kernels without the Python interpreter in the call (module docstring of the C++ source).

Built at first use by `cbuild.build_torch_ops` against the installed torch and loaded
into the process with `torch.ops.load_library`; without a C++ compiler, or when the build
or the load fails (logged once), `available()` is False and the callers keep their
operators implemented in Python, which compute the same.

Operators (namespace `inflight_native`):
    lora_bind(weights, order, starts, slots, tokens, threads, kernel)
        bind a step's LoRA grouping and kernel for the calling thread
        (`worker.model.kernels.cpu_lora.BoundKernel.bind_native`);
    lora_bind_torch(), lora_unbind()
        a step the kernel does not serve (every call takes the torch path); no step;
    lora_delta(x, y, projection)
        `inflight::lora_delta`'s contract (`worker.model.lora.lora_delta_op`);
    attention_bind(k_caches, v_caches, slots, tables, seq_lens, threads, kernel)
        bind a step (a row of the decode kernel per token) for the calling thread
        (`worker.model.attention.native_attention_step`); attention_unbind(): no step;
    attention(query, key, value, layer, scaling, sliding_window, softcap, sinks, v_head_dim)
        `inflight::attention`'s contract (`worker.model.attention.attention_op`).
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

import torch

from worker.model.kernels import cbuild

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_ops.cpp")
LOADED = False  # the operators are loaded into this process (set by the first `available()` that loads them)


_LOAD_LOCK = threading.Lock()


@functools.cache
def _loaded() -> str | None:
    """None once the operators are loaded into this process, else why they are not (logged
    once). Engines made in two threads at once load them once."""
    with _LOAD_LOCK:
        return _load()


def _load() -> str | None:
    global LOADED
    if LOADED:
        return None
    built = cbuild.build_torch_ops(SOURCE)
    why = built if isinstance(built, str) else None
    if why is None:
        try:
            torch.ops.load_library(str(built))
        except (OSError, RuntimeError) as e:
            why = f"{type(e).__name__}: {e}"
    if why is not None:
        log.warning("the CPU kernels' C++ operators are unavailable (%s); their calls go through Python", why[:500])
        return why
    torch.library.register_fake("inflight_native::lora_delta")(_lora_delta_fake)
    torch.library.register_fake("inflight_native::attention")(_attention_fake)
    LOADED = True
    return None


def _lora_delta_fake(x: torch.Tensor, y: torch.Tensor, projection: int) -> None:
    return None


def _attention_fake(query, key, value, layer, scaling, sliding_window, softcap, sinks, v_head_dim):
    return query.new_empty(1, query.shape[2], query.shape[1], v_head_dim)


def available() -> bool:
    """Whether the operators are built and loaded (builds and loads them on the first call)."""
    return _loaded() is None
