"""structlog setup: JSON lines by default, readable console output in a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(level: str = "INFO", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def task_stacks() -> dict[str, list[str]]:
    """Every asyncio task's await chain, innermost last (to diagnose a stuck worker)."""
    import asyncio

    out = {}
    for t in asyncio.all_tasks():
        frames = []
        coro = t.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                frames.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        out[t.get_name()] = frames
    return out
