"""Quiet logging of expected, transient Kafka conditions.

aiokafka logs at error or warning what every healthy fleet sees now and then: the group
coordinator not available or still loading (a fresh broker creates `__consumer_offsets`
on the first request), heartbeats refused while the group rebalances, a topic's metadata
or leader not known yet, a broker being restarted. Measured on a fresh dev stack: one
`GroupCoordinatorNotAvailableError` at error on every first start; a second worker
joining gives `Heartbeat failed ... because it is rebalancing` at warning; an 11 s broker
restart gave 1600 error lines.

`TransientLogFilter` (installed on the log handler by `worker.obs.log.setup_logging`) groups
such records into episodes per kind (`TRANSIENT_KINDS`); our own lines about the same
conditions go through `observe` and share the episodes. An episode starts with the first
record of its kind, logged at info; repeats are debug; the first record once the episode
has lasted `grace_s` (`kafka.transient_grace_s`, default 30 s) is logged once at warning
with `persisted_s`; an episode ends when its kind stays silent for `grace_s`. A condition
that recurs less often than every `grace_s` is never escalated here (/readyz and the
Kafka metrics report lasting outages). Records of other loggers, of other messages and
with tracebacks pass unchanged.

One kind is not quiet: `access_refused` (refused credentials, an untrusted or rejected
certificate, a topic "not authorized"), which aiokafka repeats on every reconnect
attempt, is logged at warning at once and then at most once per `grace_s` while it
repeats, so the cause is visible without flooding (a worker that meets it at start exits
with it instead, see `worker/security/access.py`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

TRANSIENT_GRACE_S = 30.0

# Checked in order; a message belongs to the first kind whose pattern it contains.
# Connection first: "Group Coordinator Request failed: NodeNotReadyError" is the broker
# being away, not its coordinator.
TRANSIENT_KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Refused, not away: wrong credentials, an untrusted or rejected certificate. Before
    # broker_unreachable, whose "Unable connect to" prefix these lines share.
    ("access_refused", re.compile(
        r"SaslAuthenticationFailed|UnsupportedSaslMechanism|CERTIFICATE_VERIFY_FAILED|ALERT_UNKNOWN_CA"
        r"|ALERT_BAD_CERTIFICATE|ALERT_CERTIFICATE_UNKNOWN|CERTIFICATE_REQUIRED|is not authorized"
        r"|Not authorized to")),
    ("broker_unreachable", re.compile(
        r"Unable connect to|Unable to update metadata|NodeNotReady|KafkaConnectionError|Connect call failed"
        r"|Connection at \S+ closed|RequestTimedOut")),
    ("coordinator_unavailable", re.compile(
        r"GroupCoordinatorNotAvailable|CoordinatorNotAvailable|NotCoordinator|CoordinatorLoadInProgress"
        r"|GroupLoadInProgress|is either not started or not valid|[Mm]arking (the )?coordinator dead")),
    ("rebalance", re.compile(
        r"RebalanceInProgress|because it is rebalancing|IllegalGeneration|generation id is not"
        r"|UnknownMemberId|member_id was not recognized")),
    ("topic_metadata", re.compile(
        r"not found in cluster metadata|UnknownTopicOrPartition|LeaderNotAvailable|NotLeaderForPartition"
        r"|NotLeaderOrFollower|No partition metadata for topic")),
)
TRANSIENT_LOGGERS = ("aiokafka",)
# Kinds whose cause an operator must see at once: warning on the first occurrence, then
# at most one warning per grace interval while they repeat (debug in between).
LOUD_KINDS = frozenset({"access_refused"})


def transient_kind(message: str) -> str | None:
    """The `TRANSIENT_KINDS` name a log message belongs to, or None."""
    for kind, pattern in TRANSIENT_KINDS:
        if pattern.search(message):
            return kind
    return None


@dataclass(slots=True)
class _Episode:
    start: float
    last: float
    warned: bool = False
    last_warning: float = 0.0


class TransientEpisodes:
    """Episodes of transient conditions per kind, and the level each new occurrence is
    logged at: info (first of an episode), debug (repeat), warning (once, the first
    occurrence after the episode has lasted `grace_s` seconds). An episode ends when its
    kind has not occurred for `grace_s`. Thread-safe."""

    def __init__(self, grace_s: float = TRANSIENT_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if grace_s <= 0:
            raise ValueError(f"transient grace_s must be > 0, got {grace_s}")
        self.grace_s = grace_s
        self._clock = clock
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    def observe(self, kind: str) -> tuple[int, dict]:
        """Record one occurrence of `kind` now. Returns (logging level, fields to log:
        `transient` = kind, plus `persisted_s` on the warning). `LOUD_KINDS` instead warn
        at once and then at most once per `grace_s` while they repeat."""
        now = self._clock()
        with self._lock:
            ep = self._episodes.get(kind)
            if kind in LOUD_KINDS:
                if ep is None or now - ep.last_warning >= self.grace_s:
                    ep = self._episodes[kind] = _Episode(start=now if ep is None else ep.start, last=now,
                                                         warned=True, last_warning=now)
                    level = logging.WARNING
                else:
                    level = logging.DEBUG
                    ep.last = now
                fields: dict = {"transient": kind}
                if level == logging.WARNING and now > ep.start:
                    fields["persisted_s"] = round(now - ep.start, 1)
                return level, fields
            if ep is None or now - ep.last > self.grace_s:
                ep = self._episodes[kind] = _Episode(start=now, last=now)
                level = logging.INFO
            elif not ep.warned and now - ep.start >= self.grace_s:
                ep.warned = True
                level = logging.WARNING
            else:
                level = logging.DEBUG
            ep.last = now
            fields: dict = {"transient": kind}
            if level == logging.WARNING:
                fields["persisted_s"] = round(now - ep.start, 1)
        return level, fields


class TransientLogFilter(logging.Filter):
    """A handler filter that re-levels aiokafka's transient warnings and errors through
    `episodes` (info / debug / one warning per episode that outlasts its grace) and
    writes `transient` (and `persisted_s`) on each record it changes. Records that end
    below `min_level` are dropped, as the logger's level would have dropped them.
    Other records, and records with a traceback, pass unchanged."""

    def __init__(self, episodes: TransientEpisodes, min_level: int = logging.INFO) -> None:
        super().__init__()
        self.episodes = episodes
        self.min_level = min_level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.exc_info or not record.name.startswith(TRANSIENT_LOGGERS):
            return True
        kind = transient_kind(record.getMessage())
        if kind is None:
            return True
        level, fields = self.episodes.observe(kind)
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.__dict__.update(fields)
        return level >= self.min_level


_active = TransientEpisodes()


def set_active(episodes: TransientEpisodes) -> None:
    """Make `episodes` the one `observe` uses (`worker.obs.log.setup_logging` does)."""
    global _active
    _active = episodes


def observe(kind: str) -> tuple[int, dict]:
    """For our own log lines about a transient condition: the level and fields to log an
    occurrence of `kind` with, sharing episodes with aiokafka's records, e.g.

        level, fields = observe("broker_unreachable")
        log.log(level, "stall check could not reach Kafka", **fields)
    """
    return _active.observe(kind)


def observe_error(error: BaseException, default: int = logging.WARNING) -> tuple[int, dict]:
    """`observe` for the kind `error` belongs to (by its repr); (`default`, {}) when it
    is not a known transient condition."""
    kind = transient_kind(repr(error))
    return observe(kind) if kind is not None else (default, {})
