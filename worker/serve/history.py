"""What a worker published for jobs it finished recently, kept so a Redis that restarts
empty gets their logs and done marks back (`Publisher.restore`): a client that reads a
job's log in the minutes after it ended still finds it whole. Older outcomes are in the
results topic only (`results.py`)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

from schemas.replay import LogEntry

# Published histories of finished jobs kept to re-append if Redis restarts empty.
RECENT_MAX_JOBS = 4096
RECENT_MAX_AGE_S = 120.0


class Published(NamedTuple):
    """One finished job's published log entries in order (compacted with log compaction
    on), ending with its terminal event (finish reason `reason`), under `claim_token` and
    `attempt`; `prior` the log's entries of earlier attempts when it was claimed."""

    done_time: float
    history: list[LogEntry]
    reason: str
    claim_token: str
    attempt: int
    tenant: str | None
    prior: tuple[LogEntry, ...] = ()  # earlier attempts' entries


class RecentHistories:
    """The last RECENT_MAX_JOBS jobs finished within RECENT_MAX_AGE_S seconds (by `clock`,
    wall seconds), oldest first."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._jobs: OrderedDict[str, Published] = OrderedDict()

    def add(self, job_id: str, published: Published) -> None:
        self._jobs[job_id] = published
        self._jobs.move_to_end(job_id)
        self._prune(published.done_time)

    def get(self, job_id: str) -> Published | None:
        return self._jobs.get(job_id)

    def items(self) -> Iterator[tuple[str, Published]]:
        """The jobs still within RECENT_MAX_AGE_S now (pruned first)."""
        self._prune(self._clock())
        return iter(list(self._jobs.items()))

    def _prune(self, now: float) -> None:
        jobs = self._jobs
        while jobs and (len(jobs) > RECENT_MAX_JOBS or next(iter(jobs.values())).done_time < now - RECENT_MAX_AGE_S):
            jobs.popitem(last=False)
