"""The producer's side of prefix affinity (`kafka.affinity_prefix_bytes`; the recipe is
`schemas/affinity.py`): which prefixes are hot, and so over how many partitions each is
spread.

**The spread rule.** Per job topic, a producer counts the prefix hashes of its last
`kafka.affinity_window` jobs. A prefix that carried a share `s` of them, on a topic of `P`
partitions, is spread over `k = ceil(HEADROOM x s x P)` partitions (1 <= k <= P): each of
them then gets about `s / k <= 2/3 x 1 / P` of the topic's jobs from it, two thirds of a
partition's mean share, which leaves room for the other prefixes hashed to the same
partition (with few prefixes their placement is uneven: measured, one prompt on half the
jobs over 6 partitions, `k = ceil(s x P)` left the busiest partition at 2.03x the mean).
A prefix under two thirds of one partition's share stays on one partition (one worker
computes it). Shares are taken over at least `MIN_WINDOW` jobs, so a new producer's first
jobs do not spread.

**How a producer learns the rate**: from its own jobs, nothing shared. Replicas of one
gateway behind a load balancer see the same mix and so the same shares; a producer that
sees only part of a hot prefix's traffic spreads it less, and at worst its jobs stay on
one partition, as a plain key would put them.
"""

from __future__ import annotations

import math
from collections import Counter, deque

from schemas.affinity import affinity_partition, prefix_hash
from schemas.wire import Job

MIN_WINDOW = 100  # jobs a share is counted over at least
HEADROOM = 1.5  # a prefix's partitions each get at most 1 / HEADROOM of a partition's mean share from it


class _Window:
    """The prefix hashes of a topic's last `size` affinity jobs, with their counts."""

    __slots__ = ("size", "hashes", "counts")

    def __init__(self, size: int) -> None:
        self.size = size
        self.hashes: deque[int] = deque()
        self.counts: Counter[int] = Counter()

    def add(self, h: int) -> int:
        """Count `h` in (dropping the oldest past `size`); returns its count now."""
        self.hashes.append(h)
        self.counts[h] += 1
        if len(self.hashes) > self.size:
            old = self.hashes.popleft()
            self.counts[old] -= 1
            if not self.counts[old]:
                del self.counts[old]
        return self.counts[h]


class PrefixAffinity:
    """Chooses job partitions by prompt prefix for one producer.

    Args:
        prefix_bytes: head bytes that name a prefix (`schemas.affinity.prefix_hash`); 0: off.
        window: jobs per topic whose prefixes are counted (the spread rule).
    """

    def __init__(self, prefix_bytes: int, window: int) -> None:
        self.prefix_bytes = prefix_bytes
        self.window = window
        self._windows: dict[str, _Window] = {}

    @property
    def enabled(self) -> bool:
        return self.prefix_bytes > 0

    def prefix(self, job: Job) -> int | None:
        """The job's prefix hash, None when it has no affinity (its head is shorter)."""
        return prefix_hash(job, self.prefix_bytes)

    def partition(self, topic: str, job: Job, num_partitions: int, prefix: int | None = None) -> int | None:
        """The partition of `topic` (of `num_partitions`) for `job` by its prefix, counted
        into the topic's window; None: no affinity (the default partitioner, by job id).
        `prefix`: the job's hash when the caller has it already (`prefix`)."""
        h = self.prefix(job) if prefix is None else prefix
        if h is None or num_partitions < 1:
            return None
        w = self._windows.get(topic)
        if w is None:
            w = self._windows[topic] = _Window(self.window)
        share = w.add(h) / max(len(w.hashes), MIN_WINDOW)
        return affinity_partition(h, job.job_id, math.ceil(HEADROOM * share * num_partitions), num_partitions)
