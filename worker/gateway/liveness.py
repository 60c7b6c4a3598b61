"""Fleet liveness at the gateway: a pool whose consumer group has had no live worker for
`gateway.no_worker_grace_s` is dead, and the gateway says so instead of queueing into it.

Without this a fleet with every worker stopped looked like overload: `/readyz` green, each
request queued until `queue_timeout_s` and answered 429, which the `openai` SDK retries
(97 s to an error). vLLM is simply down in that state (503 or connection refused), which
clients and load balancers handle; now a request routed to a dead pool is answered 503
`no_live_worker` at once, naming the model and the pool, and nothing is produced.
`/readyz` is unready while the default pool is dead (every job may be written there: its
workers forward what is not theirs); other pools' state is in its body and in
`gateway_live_workers{pool}`.

The counts come from the readiness checks (`worker.client.fleet`: members of each pool's
group subscribed to its job topics), every `CHECK_INTERVAL_S`. The grace covers a worker's
group join after a start or a rebalance, when the group is briefly empty. When the counts
are unknown (the principal may not describe the groups, Kafka did not answer) nothing is
refused: the old behaviour, logged once; likewise for a pool whose group the coordinator
does not know (no worker ever committed under it: a fleet not started yet, or a
`kafka.group_id` that is not the workers' — logged once per pool), so a misconfigured
gateway queues rather than refusing everything.
"""

from __future__ import annotations

import time

from schemas.pools import DEFAULT_POOL
from worker.gateway.errors import ApiError


class NoLiveWorker(Exception):
    """The default pool has had no live worker for the grace (a failed readiness check)."""


class FleetLiveness:
    """Per pool: its live workers at the last check and since when it has had none.

    Args:
        model: the served model's name (in the messages).
        grace_s: how long a pool must show no live worker before it counts as dead, seconds.
    """

    def __init__(self, model: str, grace_s: float) -> None:
        self.model = model
        self.grace_s = grace_s
        self.counts: dict[str, int] | None = None  # None: unknown
        self._empty_since: dict[str, float] = {}

    def update(self, counts: dict[str, int | None] | None, now: float | None = None) -> None:
        """Record a check's counts (None: the check could not tell; a pool's None: its
        group is unknown to the coordinator, so nothing is judged for it)."""
        now = time.monotonic() if now is None else now
        self.counts = counts
        if counts is None:
            self._empty_since.clear()
            return
        for pool, n in counts.items():
            if n is None or n > 0:
                self._empty_since.pop(pool, None)
            else:
                self._empty_since.setdefault(pool, now)

    def dead(self, pool: str, now: float | None = None) -> bool:
        """Whether `pool` has shown no live worker for at least the grace."""
        since = self._empty_since.get(pool)
        if since is None:
            return False
        return (time.monotonic() if now is None else now) - since >= self.grace_s

    def message(self, pool: str) -> str:
        return f"no live worker for model {self.model!r} (pool {pool!r})"

    def check(self, pool: str) -> None:
        """Raises ApiError 503 `no_live_worker` when `pool` is dead (a request's pool,
        before its job is produced)."""
        if self.dead(pool):
            raise ApiError(503, f"{self.message(pool)}: every worker of the pool is stopped or unreachable, so the "
                                f"request cannot run; retry when a worker is up", code="no_live_worker")

    def readiness_error(self, now: float | None = None) -> str | None:
        """Why the gateway is not ready (the default pool is dead), or None."""
        return self.message(DEFAULT_POOL) if self.dead(DEFAULT_POOL, now) else None
