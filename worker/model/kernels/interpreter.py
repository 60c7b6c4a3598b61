"""Triton's interpreter (`TRITON_INTERPRET=1`: the Triton kernels on the CPU, how the
tests check them), set up once by each Triton kernel module as it is imported."""

from __future__ import annotations

import os


def drop_interpreter_overflow_checks() -> bool:
    """Stop Triton's interpreter computing integer-overflow checks that it then discards.

    The interpreter (`TRITON_INTERPRET=1`: Triton kernels on the CPU, how the tests check
    them) builds every integer `+`, `-` and `*` with `sanitize_overflow` on (Triton 3.x:
    widen to int64, compare with both limits), but the `device_assert` that would act on
    the result returns at once unless `debug` is on, which it is not: the checks change
    nothing and were 28% of an interpreted engine step (py-spy, `tools.gpu_check --smoke`).
    Compiled kernels on a GPU are untouched. Called by each Triton kernel module when it is
    imported; with `debug` on the checks stay.

    Returns:
        whether the option was turned off (False: not interpreting, debug on, or a Triton
        whose interpreter has no such option).
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if (not dataclasses.is_dataclass(options) or getattr(options, "debug", True)
            or not getattr(options, "sanitize_overflow", False)):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
