"""structlog setup: JSON lines by default, readable console output in a terminal."""

from __future__ import annotations

import logging
import sys

import structlog

from worker.obs.trace_context import add_trace_ids
from worker.obs.transient_log import TRANSIENT_GRACE_S, TransientEpisodes, TransientLogFilter, set_active

# Fields a standard-library log call passes in `extra` to name the jobs it is about (the
# engine thread logs through `logging`): they become fields of the JSON line.
JOB_FIELDS = ["job_id", "job_ids", "num_jobs"]


def setup_logging(level: str = "INFO", json: bool | None = None, stream=None,
                  transient_grace_s: float = TRANSIENT_GRACE_S) -> None:
    """Configure structlog and the standard library's logging (used by aiokafka, the
    engine, transformers) to write one rendering to `stream` (default stderr): JSON
    lines, or colored console lines when `json` is False or, if None, when the stream
    is a terminal. aiokafka below WARNING is silenced (it is chatty); its expected
    transient warnings and errors (coordinator loading, rebalances, a broker restarting)
    are logged at info until one lasts `transient_grace_s` seconds, then once at warning
    (`worker.obs.transient_log`; the worker passes `kafka.transient_grace_s`)."""
    stream = stream or sys.stderr
    if json is None:
        json = not stream.isatty()
    shared = [
        structlog.contextvars.merge_contextvars,
        add_trace_ids,  # a line about a traced job carries its trace_id / span_id (nothing while off)
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    final = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()] if json else [
        structlog.dev.ConsoleRenderer()]
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name,
                           structlog.stdlib.ExtraAdder(allow=JOB_FIELDS + ["transient", "persisted_s"])],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    ))
    min_level = level if isinstance(level, int) else logging.getLevelName(level.upper())
    episodes = TransientEpisodes(transient_grace_s)
    set_active(episodes)
    handler.addFilter(TransientLogFilter(episodes, min_level=min_level))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.stdlib.LoggerFactory(),
        # not cached: module-level loggers follow a later setup_logging (tests, embedding)
        cache_logger_on_first_use=False,
    )
