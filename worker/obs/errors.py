"""Errors as log fields: one line per exception, and suppression that still leaves a trace.
Imports only the standard library (the client and the engine use it too)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters (no traceback)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}"[:limit] if lines else type(exc).__name__


@contextlib.contextmanager
def suppressed(log: Any, what: str, *exceptions: type[BaseException]) -> Iterator[None]:
    """`contextlib.suppress(*exceptions)` (default `Exception`) for best-effort steps
    (closing a client that never connected, a metric probe), logging what was swallowed
    at debug level: `log.debug("<what> failed (ignored): <one line>")`. `log` is a
    standard-library or structlog logger."""
    caught = exceptions or (Exception,)
    try:
        yield
    except caught as e:
        log.debug(f"{what} failed (ignored): {one_line(e)}")
