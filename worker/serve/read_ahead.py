"""The intake's read-ahead: fetched job records not taken yet, and which of them free
slots take, by priority class first and tenant share inside a class.

A worker sees only what it has read. Reading a bounded number of records per partition
beyond the jobs it holds lets it look past one tenant's backlog: a record of another
tenant that sits behind a flood in the same partition is taken as soon as a slot frees
for it, instead of after the whole flood (records are taken out of offset order; the
OffsetTracker registers them when read, so the commit point never passes one).

Choice when slots free: the highest priority class with a record first; inside it the
tenant holding the fewest jobs per weight that have not reached their terminal event
(a job only waiting for its final writes no longer counts: a tenant of short jobs has
many of its slots there at any moment, and would otherwise hold fewer requests in the
engine than its share), then the tenant that took a slot least recently (round robin:
a tie never favours the tenant whose records are older, which is the flood); each
tenant's records in the order read. A tenant at its cap of local jobs
(`worker.max_local_jobs_per_tenant`) is passed over: its records stay here while
others' are taken. With `serving_tuning.fair_share: false` the choice inside a class is
the earliest record read (tenant-blind, as before fair share); the caps still hold.

The intake only hands the engine a balanced mix of tenants, each with requests waiting
there; the token-level share among them is the engine's (fair_share.py).

Bounds: at most `per_partition` records per partition and about `max_bytes` of record
values in all (one record may pass it): the intake takes only as many records out of
the consumer as fit (the rest wait in the consumer's fetch buffer), pauses every
partition past the byte bound, and a record that still does not fit is not kept but
read again later (the intake seeks back to it).
Writer: the intake (asyncio thread).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from schemas import keys
from schemas.wire import Job

if TYPE_CHECKING:
    from aiokafka import TopicPartition

    from worker.config import ServingTuning, WorkerSettings


@dataclass(slots=True, eq=False)
class JobRecord:
    """A decoded job record with where it came from. `enqueue_time` is the record's
    Kafka timestamp (Unix seconds); `raw`/`key` the original bytes (for the DLQ; `raw`
    is None for a record whose value is null); `headers` its Kafka headers (the W3C
    trace context a producer put there, `worker.obs.tracing`). A record that is not a valid job has
    `job` None and the decode `error`."""

    job: Job | None
    priority: str
    tp: TopicPartition
    offset: int
    enqueue_time: float
    raw: bytes | None
    key: bytes | None
    error: str | None = None
    read_seq: int = 0  # order in which the read-ahead got it (set by ReadAhead.add)
    headers: tuple = ()  # the record's Kafka headers [(name, value bytes)]: its trace context
    read_time: float = 0.0  # when this worker read it (Unix s; 0: not from a fetch)
    charge: int = 0  # tokens charged to its tenant's fleet rate when taken (fleet_quota.py)

    @property
    def tenant(self) -> str:
        """The job's tenant; `""` for jobs without one (and invalid records)."""
        return (self.job.tenant or "") if self.job is not None else ""



class TenantGate(Protocol):
    """Limits beyond the local caps that a take consults (`worker.serve.fleet_quota.FleetQuota`)."""

    def blocked(self, tenant: str, held: int) -> str | None:
        """Why one more job of `tenant` may not be taken now, or None. `held`: its jobs
        held here, those taken this round included."""

    def charge(self, rec: JobRecord) -> None:
        """Charge a record just taken."""


def local_shares(tuning: ServingTuning, settings: WorkerSettings, max_local_jobs: int,
                 reserve: int = 0) -> tuple[Callable[[str], float], Callable[[str], int]]:
    """(weight, cap) of each tenant for the choice of records: its fair-share weight,
    and the most local jobs it may hold: `worker.max_local_jobs_per_tenant` (default
    max_local_jobs - reserve - max_running_requests // 2, at least 1), and no more than
    twice its running quota when it has one (more would only wait in the engine, holding
    slots other tenants could use).

    `reserve` is the high-priority reserve (`high_priority_reserve`): the default cap is
    counted from the slots a normal job may take, so a tenant that appears behind a
    flood of its own class finds half a running batch of slots open, not that half less
    the reserve (with the defaults, a quarter: one slot at max_running_requests 4, and
    its 8 short jobs then ran one after another)."""
    default_cap = settings.max_local_jobs_per_tenant or max(
        1, max_local_jobs - reserve - tuning.max_running_requests // 2)

    def weight(tenant: str) -> float:
        return tuning.tenant_policy(tenant).weight

    def cap(tenant: str) -> int:
        quota = tuning.tenant_policy(tenant).max_running_requests
        return default_cap if quota is None else min(default_cap, 2 * quota)

    return weight, cap


def high_priority_reserve(tuning: ServingTuning, settings: WorkerSettings, max_local_jobs: int) -> int:
    """Local slots lower classes leave free for high-priority jobs.

    Rule: the reserve comes only out of the slots beyond the running batch
    (`max_local_jobs - max_running_requests`, the jobs that would wait in the engine),
    so lower classes can always fill the whole running batch and always keep at least
    one slot: a reserve that left them none would starve them outright (a worker with
    `max_local_jobs` 1 would never take a normal job). Default: a quarter of those
    slots, at least 1 when there are any; 0 when there are none. An explicit
    `worker.high_priority_reserve` is capped the same way (config validation already
    refuses one >= an explicit `max_local_jobs`).
    """
    spare = max(0, max_local_jobs - tuning.max_running_requests)
    wanted = settings.high_priority_reserve
    if wanted is None:
        wanted = max(1, spare // 4) if spare else 0
    return max(0, min(wanted, spare, max_local_jobs - 1))


class ReadAhead:
    """Records fetched but not yet taken, bounded per partition and in bytes, handed out by priority and tenant share.

    Args:
        per_partition: most records kept per partition.
        max_bytes: most bytes of record values kept in all.
        fair: choose by tenant share inside a class (else by read order).
    """

    def __init__(self, per_partition: int, max_bytes: int, fair: bool = True) -> None:
        self.per_partition = per_partition
        self.max_bytes = max_bytes
        self.fair = fair
        self._num_read = 0  # records added so far: the read order
        # priority -> tenant -> records in read order
        self._queues: dict[str, dict[str, deque[JobRecord]]] = {p: {} for p in keys.PRIORITIES}
        self._per_partition: dict[Any, int] = {}
        self._last_pick: dict[str, int] = {}  # tenant -> pick number of its last record taken
        self._num_picks = 0
        self.passed_over: dict[str, str] = {}  # tenant -> why the last take passed it over
        self.num_records = 0
        self.num_bytes = 0

    def __len__(self) -> int:
        return self.num_records

    def num_waiting(self, priority: str) -> int:
        """Records of a priority class read and not taken yet."""
        return sum(len(q) for q in self._queues[priority].values())

    def waiting_by_tenant(self) -> dict[str, int]:
        """Records read and not taken yet, per tenant (all classes)."""
        out: dict[str, int] = {}
        for queues in self._queues.values():
            for tenant, q in queues.items():
                out[tenant] = out.get(tenant, 0) + len(q)
        return out

    def add(self, rec: JobRecord) -> None:
        """Keep a valid job record until a slot takes it."""
        self._num_read += 1
        rec.read_seq = self._num_read
        self._queues[rec.priority].setdefault(rec.tenant, deque()).append(rec)
        self._per_partition[rec.tp] = self._per_partition.get(rec.tp, 0) + 1
        self.num_records += 1
        self.num_bytes += len(rec.raw)

    def has_room(self, tp: Any) -> bool:
        """Whether one more record of `tp` may be kept."""
        return self._per_partition.get(tp, 0) < self.per_partition and self.num_bytes < self.max_bytes

    def room(self, tp: Any) -> int:
        """How many more records of `tp` may be kept (the byte bound aside)."""
        return max(0, self.per_partition - self._per_partition.get(tp, 0))

    def take(self, free: int, held: Mapping[str, int], weight: Callable[[str], float],
             cap: Callable[[str], int], reserve: int = 0, quota: TenantGate | None = None) -> list[JobRecord]:
        """Up to `free` records in the order described in the module docstring.

        Args:
            free: slots to fill.
            held: local jobs per tenant now (tenants absent hold none).
            weight: a tenant's weight (> 0).
            cap: the most local jobs a tenant may hold.
            reserve: slots only the highest class may take (lower classes leave that
                many of `free` empty).
            quota: further limits, the fleet-wide ones (fleet_quota.py): a tenant it
                blocks is passed over, and each record taken is charged to it.

        The tenants passed over (at a cap or a fleet limit) are left in `passed_over`,
        each with the reason (`fleet_quota.DENIAL_REASONS`).
        """
        taken: list[JobRecord] = []
        self.passed_over = {}
        if free <= 0 or not self.num_records:
            return taken
        counts = dict(held)
        for prio in keys.PRIORITIES:
            queues = self._queues[prio]
            limit = free if prio == keys.PRIORITIES[0] else free - reserve
            while len(taken) < limit and queues:
                best = None
                best_key = None
                for tenant, q in queues.items():
                    n = counts.get(tenant, 0)
                    why = "tenant_cap" if n >= cap(tenant) else quota.blocked(tenant, n) if quota is not None else None
                    if why is not None:
                        self.passed_over[tenant] = why
                        continue
                    if self.fair:
                        w = weight(tenant)
                        key = (n / w, self._last_pick.get(tenant, -1), q[0].read_seq)
                    else:
                        key = (q[0].read_seq,)
                    if best_key is None or key < best_key:
                        best, best_key = tenant, key
                if best is None:
                    break  # every tenant of this class is at its cap: lower classes may still take
                q = queues[best]
                rec = q.popleft()
                if not q:
                    del queues[best]
                    if not any(best in qs for qs in self._queues.values()):
                        self._last_pick.pop(best, None)  # bounded by the tenants with records here
                self._forget(rec)
                if quota is not None:
                    quota.charge(rec)
                counts[best] = counts.get(best, 0) + 1
                self._num_picks += 1
                self._last_pick[best] = self._num_picks
                taken.append(rec)
        return taken

    def drop(self, keep: Callable[[Any], bool]) -> int:
        """Discard the records of partitions for which `keep(tp)` is False (no longer
        assigned: their new owner reads them from the committed offset). Returns how many."""
        dropped = 0
        for queues in self._queues.values():
            for tenant in list(queues):
                q = queues[tenant]
                kept = deque(r for r in q if keep(r.tp))
                for rec in q:
                    if not keep(rec.tp):
                        self._forget(rec)
                        dropped += 1
                if kept:
                    queues[tenant] = kept
                else:
                    del queues[tenant]
        return dropped

    def _forget(self, rec: JobRecord) -> None:
        n = self._per_partition[rec.tp] - 1
        if n:
            self._per_partition[rec.tp] = n
        else:
            del self._per_partition[rec.tp]
        self.num_records -= 1
        self.num_bytes -= len(rec.raw)
