"""`drop_interpreter_overflow_checks`: Triton's interpreter computed an overflow check for
every integer op and then discarded it (its `device_assert` acts only with `debug` on).
Off, a kernel's results are the same, overflowing arithmetic included; with `debug` on
the checks stay."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

import worker.model.kernels.triton_attn  # noqa: F401  (turns the checks off on import)
from worker.model.kernels.interpreter import drop_interpreter_overflow_checks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's options")


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * 65536 + x - 7, mask=mask)  # int32: wraps for |x| >= 32768


def _run(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _scale_kernel[(1,)](x, out, x.numel(), BLOCK=8)
    return out


@pytest.fixture
def options():
    builder = interpreter.interpreter_builder
    saved = builder.options
    yield builder
    builder.options = saved


def test_the_checks_are_off_once_a_kernel_module_is_imported_and_results_do_not_change(options):
    assert options.options.sanitize_overflow is False and options.options.debug is False
    x = torch.tensor([0, 1, -3, 40000, -70000, 2**31 - 1], dtype=torch.int32)
    lean = _run(x)
    options.options = dataclasses.replace(options.options, sanitize_overflow=True)
    assert torch.equal(_run(x), lean)
    want = ((x.long() * 65536 + x.long() - 7 + 2**31) % 2**32 - 2**31).int()  # two's complement wrap
    assert torch.equal(lean, want)


def test_with_debug_on_the_checks_stay(options):
    options.options = dataclasses.replace(options.options, debug=True, sanitize_overflow=True)
    assert drop_interpreter_overflow_checks() is False and options.options.sanitize_overflow is True
    options.options = dataclasses.replace(options.options, debug=False)
    assert drop_interpreter_overflow_checks() is True and options.options.sanitize_overflow is False
