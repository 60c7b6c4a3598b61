"""The intake's watchdog for a consumer that stopped fetching: partitions have unread
records, the worker has free slots, yet no record came for `kafka.stall_timeout_s`.
aiokafka has been seen to stop fetching after a group member died (every assigned
partition silent, no error); the remedy, which the intake applies, is a fresh consumer.
Unread is measured from the log start, so records deleted by retention never look like a
stall, and a broker that does not answer is an outage (readiness reports it), not a stall.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog
from aiokafka.errors import IllegalStateError, KafkaError

from worker.obs import transient_log

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from worker.serve.offsets import OffsetTracker

log = structlog.get_logger(__name__)


class StallWatchdog:
    """Recreates a consumer that silently stopped fetching although its partitions hold records.

    Args: stall_timeout_s: seconds without progress before the partitions are checked
        (then at most every half of it)."""

    def __init__(self, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.last_progress = time.monotonic()
        self._last_check = 0.0

    def progress(self) -> None:
        """Records came, or nothing is wanted: not a stall."""
        self.last_progress = time.monotonic()

    @property
    def stalled_s(self) -> float:
        return time.monotonic() - self.last_progress

    async def stalled(self, consumer: AIOKafkaConsumer, tracker: OffsetTracker[TopicPartition],
                      log_start: dict[TopicPartition, int]) -> list[TopicPartition]:
        """The assigned partitions with records past the committed offset, the log start
        and what this worker read, once `stall_timeout_s` passed without progress; empty
        before that, between checks, or when the broker does not answer (each broker call
        bounded at 10 s). Updates `log_start` with what it read."""
        now = time.monotonic()
        stall_s = self.stall_timeout_s
        if now - self.last_progress < stall_s or now - self._last_check < stall_s / 2:
            return []
        self._last_check = now
        assigned = list(consumer.assignment())
        if not assigned:
            return []
        try:
            async with asyncio.timeout(10):
                ends = await consumer.end_offsets(assigned)
            async with asyncio.timeout(10):
                starts = await consumer.beginning_offsets(assigned)
            async with asyncio.timeout(10):
                committed = await asyncio.gather(*(consumer.committed(tp) for tp in assigned))
        except (TimeoutError, KafkaError, IllegalStateError) as e:
            # A fresh consumer would not fetch either. Quiet while it may be a broker
            # restart (kafka.transient_grace_s).
            level, fields = transient_log.observe("broker_unreachable")
            log.log(level, "stall check could not reach Kafka; not recreating the consumer", error=repr(e), **fields)
            return []
        log_start.update(starts)
        lagging = [tp for tp, c in zip(assigned, committed)
                   if ends[tp] > max(c or 0, starts[tp], tracker.last_read(tp) + 1)]
        if not lagging:
            self.last_progress = now
        return lagging
