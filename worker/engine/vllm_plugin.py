"""A vLLM general plugin (entry point group `vllm.general_plugins`) that the worker's vLLM
core process and vLLM's own worker processes load at start (`model.engine: vllm`;
`vllm_spec._package_shim` declares it). Runs in vLLM's interpreter; imports vLLM and torch
only.

What it does: on vLLM's CPU platform, base-model tokens in a batch with LoRA requests
get no adapter delta. vLLM marks such a token with the slot index -1 ("no LoRA");
its Triton kernels (CUDA) skip it, but the plain-torch ops its CPU platform uses
(`vllm/lora/ops/torch_ops/lora_ops.py`, vLLM 0.32) index the stacked adapter weights
with it, and -1 picks the *last* slot: once a batch holds `max_loras` distinct adapters,
every base-model request in it decodes as if it had the last one (wrong tokens, no
error; found by `tests/vllm/test_vllm_lora.py`; vLLM's own fixes, PRs #48421 and #49656,
are open upstream). The fix here zeroes those tokens' rows of the ops' input, so their delta
is exactly zero; it is applied only when a probe of the installed ops shows the fault,
so a vLLM that fixed it runs untouched.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")  # the sgmv_* ops delegate to these


def register() -> None:
    """The plugin's entry point (vLLM may call it more than once per process)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        mask_no_lora_rows()


def mask_no_lora_rows() -> bool:
    """Wrap vLLM's CPU LoRA ops so index -1 adds nothing, if they alias it; True if wrapped
    (now or before)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops.bgmv_shrink, "inflight_masked", False):
        return True
    if not _aliases_last_slot(lora_ops.bgmv_shrink):
        return False
    for name in _OPS:
        fixed = _masked(getattr(lora_ops, name))
        setattr(lora_ops, name, fixed)  # what the sgmv_* ops call
        if hasattr(punica_cpu, name):
            setattr(punica_cpu, name, fixed)  # imported by name there
    log.info("vLLM's CPU LoRA ops would give base-model tokens the last adapter's delta: masked (vllm_plugin.py)")
    return True


def _masked(op):
    """`op(inputs, weights, output, indices, ...)` with the rows of index -1 zeroed in
    `inputs` and their index set to 0: their delta is 0 @ weights[0] = 0."""

    @functools.wraps(op)
    def masked(inputs, weights, output, indices, *args, **kwargs):
        none = indices < 0
        if bool(none.any()):
            inputs = inputs.masked_fill(none.unsqueeze(-1), 0)
            indices = indices.clamp(min=0)
        return op(inputs, weights, output, indices, *args, **kwargs)

    masked.inflight_masked = True
    return masked


def _aliases_last_slot(shrink) -> bool:
    """Whether `shrink` gives a token of index -1 the last slot's delta (one 1-row probe)."""
    import torch

    weights = torch.zeros(2, 1, 1, 1)
    weights[1] = 1.0  # slot 1 of 2: what -1 would alias
    out = torch.zeros(1, 1)
    shrink(torch.ones(1, 1), weights, out, torch.tensor([-1]), 1.0)
    return bool(out.abs().sum() > 0)
