"""Ending a process at once when its stop has finished. Standard library only: the engine
core's step loop (`core_proc.serve_core`) runs in vLLM's interpreter too (`model.engine:
vllm`), which has neither structlog nor our other dependencies
(tests/unit/test_vllm_side_imports.py)."""

from __future__ import annotations

from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End this process with `code` at once, after its log lines and standard streams are
    flushed: for a worker or an engine core process whose stop has finished (every
    component closed, each step bounded above), so that the interpreter's teardown of the
    torch and transformers modules (2.8 s for a worker and 3.3-4 s for its core process
    under load on the 2-core box; a SIGTERM's drain took 11.6 s in a busy CI run against
    a 10 s bound) is not time a stopping worker spends before its exit. Skips `atexit`
    handlers and finalizers: call it only once nothing is left to flush or join."""
    import contextlib
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader is gone: nothing to save
            stream.flush()
    os._exit(code)
