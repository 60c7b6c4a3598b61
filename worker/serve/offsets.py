"""Per-partition commit points: commit only below the lowest unfinished offset.

An offset is registered when its record is *read* (fetched), in increasing order per
partition as Kafka hands them out; the worker then takes records out of that order
(by priority and tenant share) and jobs finish out of order. Unfinished means read and
not done, whether the record still waits in the read-ahead or its job runs, so the
commit point (the first offset not done, or last + 1 when all are) never passes a
record read ahead:

    offsets read:   40  41  42  43  44  45
    taken:           x   x       x   x          (42 and 45 wait in the read-ahead)
    done:            x   x       x
    commit point:           42                  (nothing at or after 42 is lost on a crash)

Kafka's committed offset is "the next record to read", so committing 42 means a
restarted consumer re-reads 42 to 45: at-least-once, and the claim/done keys in Redis
keep the visible outcome exactly-once. The same registry de-duplicates re-reads: after
a rebalance that keeps a partition, the consumer reads again from the committed offset,
and every offset up to the highest read is refused (`read` returns False), whether it
waits here, runs or is done. Writers (asyncio thread): the intake (reads, commits,
rebalances) and the finalizer, the only caller of `done` (finalize.py).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

TP = TypeVar("TP")


class OffsetTracker(Generic[TP]):
    def __init__(self) -> None:
        self._pending: dict[TP, deque[int]] = {}
        self._done: dict[TP, set[int]] = {}
        self._next: dict[TP, int] = {}  # commit point once all pending are done
        self._committed: dict[TP, int] = {}
        self._last: dict[TP, int] = {}  # highest offset read

    def read(self, tp: TP, offset: int) -> bool:
        """Register that the record at `offset` of `tp` was read and is not finished.

        Returns False (and changes nothing) for an offset at or below the highest one
        already read from `tp`: after a rebalance that keeps the partition, the consumer
        re-reads from the committed offset, and those records are already here (waiting
        in the read-ahead, running, or finished).
        """
        last = self._last.get(tp)
        if last is not None and offset <= last:
            return False
        self._last[tp] = offset
        self._pending.setdefault(tp, deque()).append(offset)
        self._done.setdefault(tp, set())
        return True

    def done(self, tp: TP, offset: int) -> None:
        """Mark `offset` finished (its terminal event is in Redis, or it was skipped), in any order."""
        q = self._pending.get(tp)
        if q is None:
            return  # partition revoked meanwhile
        done = self._done[tp]
        done.add(offset)
        while q and q[0] in done:
            first = q.popleft()
            done.discard(first)
            self._next[tp] = first + 1

    def commit_point(self, tp: TP) -> int | None:
        """Offset to commit for `tp` (the lowest unfinished, or last done + 1), or None
        if nothing new since the last `mark_committed`."""
        q = self._pending.get(tp)
        point = q[0] if q else self._next.get(tp)
        if point is None or point <= self._committed.get(tp, -1):
            return None
        return point

    def commit_points(self) -> dict[TP, int]:
        out = {}
        for tp in list(self._pending):
            p = self.commit_point(tp)
            if p is not None:
                out[tp] = p
        return out

    def mark_committed(self, tp: TP, offset: int) -> None:
        """Record the group's committed offset for `tp` (after a commit, or as found on assignment)."""
        self._committed[tp] = offset

    def committed(self, tp: TP) -> int | None:
        """The group's committed offset for `tp` as last recorded, or None."""
        return self._committed.get(tp)

    def last_read(self, tp: TP) -> int:
        """Highest offset read from `tp`, or -1."""
        return self._last.get(tp, -1)

    def skip_to(self, tp: TP, offset: int) -> None:
        """Nothing below `offset` exists any more (records deleted by retention): make
        `offset` the commit point of `tp` unless records at or above it are pending."""
        self._done.setdefault(tp, set())
        q = self._pending.setdefault(tp, deque())
        if not q and offset > self._next.get(tp, -1):
            self._next[tp] = offset
        if offset - 1 > self._last.get(tp, -1):
            self._last[tp] = offset - 1

    def drop(self, tp: TP) -> None:
        """Forget a revoked partition (its new owner re-reads from the committed offset)."""
        self._pending.pop(tp, None)
        self._done.pop(tp, None)
        self._next.pop(tp, None)
        self._committed.pop(tp, None)
        self._last.pop(tp, None)

    def partitions(self) -> list[TP]:
        return list(self._pending)
