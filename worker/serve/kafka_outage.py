"""One rule for every part of the worker that talks to Kafka while jobs run (the intake,
the cancel listener, the results and DLQ writes, the readiness check): a transient broker
error is retried with backoff and reported, never a reason to stop. While Kafka is away a
worker keeps stepping the jobs it holds and streaming their tokens through Redis;
outcomes wait for the results topic (a finishing job keeps its slot, so intake stops
when `worker.max_local_jobs` more are waiting); offsets are committed when the broker is
back (a redelivered job is not run again: its done mark answers it). Only a refusal
(authorization, credentials: `access.is_fatal_kafka`) or an outage longer than
`kafka.outage_limit_s` stops the worker (`KafkaUnavailable`, exit 1).

`KafkaOutage` is the shared record: each part reports `failed(part, error)` /
`ok(part)`; an episode starts at the first failure of any part (one warning naming the
part and the error, the `kafka_outage` gauge at 1) and ends when every part that failed
has succeeded again (one warning with its length); `watch` raises KafkaUnavailable once
the oldest unresolved failure is older than the limit.

`stop_client` stops an aiokafka consumer or producer with bounded waits and without
leaking it: aiokafka 0.14's `AIOKafkaConsumer.stop()` re-raises the cancellation of its
own pending fetch tasks (aio-libs/aiokafka#647), which left the client open ("Unclosed
AIOKafkaConsumer") and a traceback in the worker's last lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import structlog

from worker.security.kafka import KafkaUnavailable

if TYPE_CHECKING:
    from worker.obs.metrics import Metrics

log = structlog.get_logger(__name__)


class KafkaOutage:
    """Args: limit_s: `kafka.outage_limit_s`; metrics: sets `kafka_outage` (optional);
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
        """`part` (e.g. "cancels") met a transient Kafka error."""
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

    async def watch(self, interval_s: float = 1.0) -> None:
        """Until cancelled; raises KafkaUnavailable once a failure is unresolved for
        longer than the limit."""
        while True:
            await asyncio.sleep(interval_s)
            if self._since and self.down_s > self.limit_s:
                parts = ", ".join(f"{p}: {self._last_error.get(p, '?')}" for p in sorted(self._since))
                raise KafkaUnavailable(f"Kafka unreachable for more than kafka.outage_limit_s = {self.limit_s} s "
                                       f"({parts})")


async def stop_client(client: Any, name: str, timeout_s: float = 15.0) -> None:
    """Stop an aiokafka consumer or producer within `timeout_s` (seconds) and close its
    connections whatever its `stop()` did; logs a warning when it did not stop cleanly.
    A cancellation of the caller itself still propagates."""
    try:
        await asyncio.wait_for(client.stop(), timeout_s)
        return
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        why = "aiokafka re-raised a cancellation of its own tasks"
    except Exception as e:  # a timeout, a broker error while leaving the group
        why = repr(e)[:200]
    log.warning("Kafka client did not stop cleanly; closing its connections", component=name, error=why)
    fetcher = getattr(client, "_fetcher", None)
    pending = [t for t in getattr(fetcher, "_pending_tasks", ()) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    inner = getattr(client, "_client", None)
    if inner is not None:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(inner.close(), 5)
