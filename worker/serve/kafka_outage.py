"""One rule for every part of the worker that talks to Kafka while jobs run (the intake,
the cancel listener, the results and DLQ writes, the readiness check): a transient broker
error is retried with backoff and reported, never a reason to stop. While Kafka is away a
worker keeps stepping the jobs it holds and streaming their tokens through Redis;
outcomes wait for the results topic (a finishing job keeps its slot, so intake stops
when `worker.max_local_jobs` more are waiting); offsets are committed when the broker is
back (a redelivered job is not run again: its done mark answers it). Only a refusal
(authorization, credentials: `access.is_fatal_kafka`) or an outage longer than
`kafka.outage_limit_s` stops the worker (`KafkaUnavailable`, exit 1). The same holds for a
broker that is away while the worker starts (`ride_out`): it waits, not ready, instead of
exiting for its orchestrator to restart it.

`KafkaOutage` is the shared record: each part reports `failed(part, error)` /
`ok(part)`; an episode starts at the first failure of any part (one warning naming the
part and the error, the `kafka_outage` gauge at 1) and ends when every part that failed
has succeeded again (one warning with its length); `watch` raises KafkaUnavailable once
the oldest unresolved failure is older than the limit.

Every aiokafka client is stopped through `worker.security.kafka.stop_client` (bounded,
never leaking the client, whatever aiokafka's own `stop()` raises).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog
from aiokafka.errors import KafkaError

from worker.security.access import is_fatal_kafka
from worker.security.kafka import KafkaUnavailable

if TYPE_CHECKING:
    from worker.obs.metrics import Metrics

log = structlog.get_logger(__name__)


class KafkaOutage:
    """Transient Kafka errors of every part, reported in one place; the `kafka.outage_limit_s` stop.

    Args: limit_s: `kafka.outage_limit_s`; metrics: sets `kafka_outage` (optional);
        clock: monotonic seconds (tests)."""

    def __init__(self, limit_s: float, metrics: Metrics | None = None, clock=time.monotonic) -> None:
        self.limit_s = limit_s
        self.metrics = metrics
        self._clock = clock
        self._since: dict[str, float] = {}  # part -> first failure of its current run of failures
        self._last_error: dict[str, str] = {}
        self.episode_since: float | None = None
        self.num_episodes = 0

    @property
    def down(self) -> bool:
        return bool(self._since)

    @property
    def down_s(self) -> float:
        """Seconds since the oldest unresolved failure (0 when Kafka answers)."""
        return self._clock() - min(self._since.values()) if self._since else 0.0

    def failed(self, part: str, error: BaseException) -> None:
        """`part` (e.g. "cancels") met a transient Kafka error (counted by its class)."""
        if self.metrics is not None:
            self.metrics.kafka_errors.labels(part, type(error).__name__).inc()
        now = self._clock()
        self._since.setdefault(part, now)
        self._last_error[part] = repr(error)[:200]
        if self.episode_since is None:
            self.episode_since = now
            self.num_episodes += 1
            log.warning("Kafka unreachable; retrying (held jobs keep running and streaming; outcomes and commits "
                        "wait)", part=part, error=repr(error)[:200], limit_s=self.limit_s)
            if self.metrics is not None:
                self.metrics.kafka_outage.set(1)

    def ok(self, part: str) -> None:
        """`part` just talked to Kafka."""
        if self._since.pop(part, None) is None or self._since:
            return
        log.warning("Kafka reachable again", outage_s=round(self._clock() - (self.episode_since or 0.0), 1))
        self.episode_since = None
        if self.metrics is not None:
            self.metrics.kafka_outage.set(0)

    async def ride_out(self, part: str, start: Callable[[], Awaitable[None]],
                       sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Start a Kafka client of the worker's start (`part`: "producer", "intake",
        "cancels"), riding out a broker that is away as the running worker does: a
        transient error is reported (`failed`: the warning, `kafka_outage` at 1; the
        worker is not ready until its start ends) and retried with backoff (0.5 s
        doubling to 5 s), and `ok` once it started.

        Raises:
            KafkaUnavailable: still failing `kafka.outage_limit_s` after the first failure.
            the error itself when it is a refusal (`access.is_fatal_kafka`) or not Kafka's.
        """
        delay = 0.5
        while True:
            try:
                await start()
            except KafkaError as e:
                if is_fatal_kafka(e):
                    raise
                self.failed(part, e)
                if self.down_s > self.limit_s:
                    raise KafkaUnavailable(f"Kafka unreachable at start for more than kafka.outage_limit_s = "
                                           f"{self.limit_s} s ({part}: {e!r})") from e
                await sleep(delay)
                delay = min(2 * delay, 5.0)
            else:
                self.ok(part)
                return

    async def watch(self, interval_s: float = 1.0) -> None:
        """Until cancelled; raises KafkaUnavailable once a failure is unresolved for
        longer than the limit."""
        while True:
            await asyncio.sleep(interval_s)
            if self._since and self.down_s > self.limit_s:
                parts = ", ".join(f"{p}: {self._last_error.get(p, '?')}" for p in sorted(self._since))
                raise KafkaUnavailable(f"Kafka unreachable for more than kafka.outage_limit_s = {self.limit_s} s "
                                       f"({parts})")
