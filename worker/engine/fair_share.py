"""Per-tenant fair share inside a priority class, and per-tenant quotas: which waiting
request of a class starts next, and which tenant yields when one must.

Fairness is the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI 2024), applied at iteration level. Each (priority class, tenant)
pair has a counter of the service its requests received, in weighted tokens divided by
the tenant's weight w (`serving_tuning.tenants`, default 1):

    counter += fair_prefill_weight / w   per prompt token at first admission
                                         (prefix-cache hits excluded: not computed)
    counter += fair_decode_weight / w    per output token sampled

A recompute after a preemption is charged nothing: it is the engine's cost, not service
the tenant asked for. The rules built on the counters:

  - Resume first: a preempted request (a started stream, waiting for its blocks back)
    is picked before every request of its class that has not started, earliest
    preempted first, whatever its tenant's counter: its recompute is the engine's debt,
    and its client is reading a stream that stalled (vLLM puts preempted requests back
    at the head of its waiting queue). Quotas still hold: a tenant at a cap waits.
    Except for a tenant owing a slot: if resuming would give its tenant a slot the
    Yield rule below hands at once to a waiting tenant, the preempted request waits
    behind Pick (resumed, it would block that tenant's Yield, and be preempted again:
    a tenant that arrived behind a flood would otherwise get one slot, its next request
    starting only when its last ended and the resumed victim's slot went back).
  - Pick: among the class's tenants with waiting requests that are under their quotas,
    the one with the least counter starts its earliest request (ties: fewer running
    requests per weight, then earliest request).
  - Lift: a tenant that becomes active in a class (its first waiting or running request
    there) has its counter raised to the least counter of the class's active tenants;
    if none is active, to the largest counter a tenant left the class with. So a tenant
    banks no credit while idle: it starts level with those being served now (VTC's
    counter lift). Active rather than only waiting tenants set the level, so a tenant
    that has all its requests running is not overtaken by credit it never left unused.
    One refinement: a tenant back within FAIR_MEMORY_STEPS keeps the lag it left with
    (its counter minus the least of the others then, if negative), so a one-step gap
    in a steady stream (all its requests ended before the worker handed it the next)
    does not erase an under-service it suffered while backlogged; the lag is bounded
    by the fairness bound and never grows while the tenant is away.
  - Yield: a waiting request of tenant W may preempt a running request of the same
    class and rank from a tenant V that is not behind it (counter_V >= counter_W) and
    holds more of the class's running slots per weight than W would with one more,
    share_V = n_V / w_V > share_W' = (n_W + 1) / w_W, when either
      (a) share_V >= YIELD_SHARE_FACTOR x share_W' (2: a tenant with no slot takes one
          at once from a tenant with two or more), or
      (b) W is behind by YIELD_LAG or more (counter_V - counter_W >= 64), so a small
          batch is not left split 3:1 for a whole request lifetime once the counters
          tell;
    one slot at a time while that holds, and only in a step after one in which no
    running request ended or was preempted: while slots free up, Pick gives the next
    one to the tenant behind within a step, with nothing to recompute. Pick alone
    needs no preemption and does the fine balance. A slot cannot move straight back: by (a), V would need twice W's
    share while holding less than half of it; by (b), V would have to fall YIELD_LAG
    behind W, i.e. W be served 2 x YIELD_LAG more than V first, which bounds how often
    two tenants trade a slot. Victims
    inside V are its latest arrivals, never one admitted in the same step or one
    holding prompt + max_tokens, so the preemption bound of scheduler.py is unchanged.

Quotas (`TenantPolicy.max_running_requests`, `max_kv_blocks`) are per tenant across
classes: a tenant at a cap is passed over by Pick (its requests wait, others start).

Writer: the Scheduler (engine thread) is the only caller.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from worker.engine.request import RequestStatus

if TYPE_CHECKING:
    from worker.config import ServingTuning, TenantPolicy
    from worker.engine.request import Request

# Counters of tenants that left a class, remembered so a quick return cannot shed a
# lead; beyond this many the oldest are forgotten (they are then lifted like new ones).
MAX_DEPARTED_TENANTS = 4096
# A tenant back within this many steps keeps the lag behind the others it left with.
FAIR_MEMORY_STEPS = 256
# Yield at once from a tenant holding at least this many times the slot share (per
# weight) the waiting tenant would hold after the move (rule (a)); with a factor near 1
# and no lag, simulations preempted ~5x more often for no better token shares.
YIELD_SHARE_FACTOR = 2
# ... or from a tenant holding more than that share at all once the waiting tenant is this
# far behind it (counter units: weighted tokens / weight), so a small batch cannot stay
# split 3:1 for a whole request lifetime while counters could already tell.
YIELD_LAG = 64.0


class Tenant:
    """Quota state of one tenant over all classes, while it has requests in the scheduler."""

    __slots__ = ("name", "weight", "max_running", "max_kv_blocks", "num_running", "num_requests")

    def __init__(self, name: str, policy: TenantPolicy) -> None:
        self.name = name
        self.weight = policy.weight
        self.max_running = policy.max_running_requests
        self.max_kv_blocks = policy.max_kv_blocks
        self.num_running = 0
        self.num_requests = 0

    @property
    def is_at_running_cap(self) -> bool:
        return self.max_running is not None and self.num_running >= self.max_running


class TenantQueue:
    """One tenant inside one priority class: its waiting requests (two heaps by arrival:
    short prompts, and long ones when prompt-length tiering is on, so a step whose
    long-prefill cap is spent passes over the long ones without visiting them), its running
    requests and its virtual token counter (weighted tokens / weight)."""

    __slots__ = ("tenant", "counter", "prefill_cost", "decode_cost", "waiting", "waiting_long", "running")

    def __init__(self, tenant: Tenant, counter: float, tuning: ServingTuning) -> None:
        self.tenant = tenant
        self.counter = counter
        self.prefill_cost = tuning.fair_prefill_weight / tenant.weight
        self.decode_cost = tuning.fair_decode_weight / tenant.weight
        self.waiting: list[tuple[int, Request]] = []  # (arrival_seq, request), a heap
        self.waiting_long: list[tuple[int, Request]] = []  # the long prompts (tiering.LongPrefillCap.is_long)
        self.running: dict[str, Request] = {}  # by request id; written by the Scheduler

    def head(self, skip_long: bool) -> tuple[int, Request] | None:
        """(arrival_seq, request) of the earliest waiting request; with `skip_long`, of the
        earliest short one. None if there is none."""
        short = self.waiting[0] if self.waiting else None
        if skip_long or not self.waiting_long:
            return short
        long = self.waiting_long[0]
        return long if short is None or long[0] < short[0] else short

    @property
    def share(self) -> float:
        """Running requests per weight."""
        return len(self.running) / self.tenant.weight

    def __repr__(self) -> str:
        return (f"TenantQueue({self.tenant.name!r}, counter={self.counter:.1f}, "
                f"waiting={len(self.waiting) + len(self.waiting_long)}, "
                f"running={len(self.running)})")


class ClassQueue:
    """The waiting requests of one priority class, by tenant, and the class's counters.

    Args:
        priority: the class (Priority value).
        tuning: weights and `fair_share`; with `fair_share` off, Pick takes the class's
            earliest waiting request (arrival order) and nothing is charged.
        is_long: whether a request waits among its tenant's long prompts (prompt-length
            tiering's rule, `tiering.LongPrefillCap.is_long`); none are long by default.
    """

    def __init__(self, priority: int, tuning: ServingTuning,
                 is_long: Callable[[Request], bool] = lambda req: False) -> None:
        self.priority = priority
        self.is_long = is_long
        self.tuning = tuning
        self.fair = tuning.fair_share
        self.active: dict[str, TenantQueue] = {}  # tenants with a waiting or running request here
        self.backlogged: dict[str, TenantQueue] = {}  # those with a waiting request that has not started
        self.preempted: list[tuple[int, Request]] = []  # heap by arrival: preempted requests, resumed first
        self.num_waiting = 0
        self.num_waiting_long = 0  # of them, in their tenants' long-prompt heaps
        # tenant -> (counter, lag behind the least of the others, step) when it left
        self._departed: OrderedDict[str, tuple[float, float, int]] = OrderedDict()
        self._floor = 0.0  # largest counter a tenant left with: the lift when none is active

    # ---- membership ----------------------------------------------------------------
    def join(self, tenant: Tenant, step: int) -> TenantQueue:
        """The tenant's queue in this class, made active with the lift if it was not."""
        tq = self.active.get(tenant.name)
        if tq is None:
            counter, lag, left_at = self._departed.pop(tenant.name, (0.0, 0.0, -FAIR_MEMORY_STEPS))
            level = min(q.counter for q in self.active.values()) if self.active else self._floor
            if step - left_at <= FAIR_MEMORY_STEPS:
                level += lag
            tq = self.active[tenant.name] = TenantQueue(tenant, max(counter, level), self.tuning)
        return tq

    def leave_if_idle(self, tq: TenantQueue, step: int) -> None:
        """Deactivate a tenant with nothing waiting or running here; remember its counter."""
        if tq.running or tq.waiting or tq.waiting_long or self.active.get(tq.tenant.name) is not tq:
            return
        del self.active[tq.tenant.name]
        lag = min(0.0, tq.counter - min(q.counter for q in self.active.values())) if self.active else 0.0
        self._floor = max(self._floor, tq.counter)
        self._departed[tq.tenant.name] = (tq.counter, lag, step)
        if len(self._departed) > MAX_DEPARTED_TENANTS:
            self._departed.popitem(last=False)

    # ---- waiting requests ----------------------------------------------------------
    def push(self, req: Request) -> None:
        if req.status == RequestStatus.PREEMPTED:
            heapq.heappush(self.preempted, (req.arrival_seq, req))
            self.num_waiting += 1
            return
        tq = req.share
        if self.is_long(req):
            heapq.heappush(tq.waiting_long, (req.arrival_seq, req))
            self.num_waiting_long += 1
        else:
            heapq.heappush(tq.waiting, (req.arrival_seq, req))
        self.backlogged[tq.tenant.name] = tq
        self.num_waiting += 1

    def pop(self, req: Request) -> None:
        """Take `req`, as returned by `pick` (a preempted request, or the head of its
        tenant's queue)."""
        if req.status == RequestStatus.PREEMPTED:
            self.preempted.remove((req.arrival_seq, req))
            heapq.heapify(self.preempted)
            self.num_waiting -= 1
            return
        tq = req.share
        heap = tq.waiting_long if tq.waiting_long and tq.waiting_long[0][1] is req else tq.waiting
        popped = heapq.heappop(heap)[1]
        assert popped is req, (popped, req)
        self._left(tq, heap)

    def remove(self, req: Request) -> None:
        """Drop a waiting request that ended (abort, deadline) from anywhere in its queue."""
        if req.status == RequestStatus.PREEMPTED:
            self.pop(req)
            return
        tq = req.share
        entry = (req.arrival_seq, req)
        heap = tq.waiting_long if entry in tq.waiting_long else tq.waiting
        heap.remove(entry)
        heapq.heapify(heap)
        self._left(tq, heap)

    def _left(self, tq: TenantQueue, heap: list[tuple[int, Request]]) -> None:
        """A request left `heap` of `tq`: the counts, and the tenant is no longer backlogged if that was its last."""
        if heap is tq.waiting_long:
            self.num_waiting_long -= 1
        if not (tq.waiting or tq.waiting_long):
            del self.backlogged[tq.tenant.name]
        self.num_waiting -= 1

    def pick(self, excluded: set[Tenant], skip_long: bool = False) -> tuple[Request, Request] | None:
        """(next request: the earliest preempted one, else by Pick; earliest waiting
        request) over tenants not in `excluded`, or None if every waiting tenant is
        excluded. The earliest request gives the class its aged rank. With `skip_long`
        (the step's long-prefill cap is spent) the long prompts in the tenants' queues are
        passed over, however many wait (a preempted one is still returned: admission
        defers it). O(waiting tenants + preempted requests)."""
        best = oldest = None
        best_counter = math.inf
        oldest_seq = math.inf
        fair = self.fair
        resume = None
        for seq, req in self.preempted:
            if (not excluded or req.share.tenant not in excluded) and (resume is None or seq < resume.arrival_seq):
                resume = req
        if resume is not None:
            oldest_seq, oldest = resume.arrival_seq, resume
            if fair and self._would_yield_resumed(resume.share, excluded):
                resume = self._resumable(excluded)
        for tq in self.backlogged.values():
            if excluded and tq.tenant in excluded:
                continue
            head = tq.head(skip_long)
            if head is None:
                continue
            seq, req = head
            if seq < oldest_seq:
                oldest_seq, oldest = seq, req
            if fair:
                counter = tq.counter
                if counter < best_counter or (counter == best_counter and _tie_first(tq, seq, best)):
                    best_counter, best = counter, req
        if oldest is None:
            return None
        if resume is not None:
            return resume, oldest
        return (best if fair else oldest), oldest

    def _resumable(self, excluded: set[Tenant]) -> Request | None:
        """The earliest preempted request (not excluded) whose tenant owes no slot; the
        slow path of `pick`, when the earliest of all does (O(P log P))."""
        owes: dict[str, bool] = {}
        for _, req in sorted(self.preempted):
            tq = req.share
            if excluded and tq.tenant in excluded:
                continue
            if tq.tenant.name not in owes:
                owes[tq.tenant.name] = self._would_yield_resumed(tq, excluded)
            if not owes[tq.tenant.name]:
                return req
        return None

    def _would_yield_resumed(self, v: TenantQueue, excluded: set[Tenant]) -> bool:
        """Whether tenant `v`, with one more running request, would yield it by the
        Yield rule to a tenant waiting here (not excluded): then its preempted request
        does not resume first (the slot would be taken back at once, a recompute wasted,
        and the resumed request would stand before the waiting tenant's Yield)."""
        n = len(v.running) + 1
        return any(_yields(v, n, w) for w in self.backlogged.values() if not (excluded and w.tenant in excluded))

    # ---- yielding --------------------------------------------------------------------
    def may_yield(self, tq: TenantQueue) -> bool:
        """Whether some other active tenant would yield a slot to `tq` by the Yield rule
        (necessary for a Yield: victims must also qualify; O(active tenants))."""
        if not self.fair:
            return False
        counter = tq.counter
        after = (len(tq.running) + 1) / tq.tenant.weight
        at_once = YIELD_SHARE_FACTOR * after
        for v in self.active.values():  # _yields inlined: this runs every step the batch is full
            if v.counter >= counter and v is not tq:
                share = len(v.running) / v.tenant.weight
                if share >= at_once or (share > after and v.counter - counter >= YIELD_LAG):
                    return True
        return False

    def yield_victims(self, tq: TenantQueue, can_yield: Callable[[Request], bool]) -> Iterator[Request]:
        """Running requests of this class in the order they yield to a request of `tq`:
        repeatedly the latest arrival (among those `can_yield` accepts: the waiting
        request's rank, unreserved, not admitted this step) of the tenant furthest over
        its share (then the most served), while the Yield rule holds after the moves
        before it. Only the first victim's slot is needed; more free blocks."""
        left = {v: len(v.running) for v in self.active.values() if _yields(v, len(v.running), tq)}
        candidates: dict[TenantQueue, list[Request]] = {}
        while left:
            v = max(left, key=lambda v: (left[v] / v.tenant.weight, v.counter))
            if not _yields(v, left[v], tq):
                del left[v]
                continue
            reqs = candidates.get(v)
            if reqs is None:
                reqs = candidates[v] = sorted((r for r in v.running.values() if can_yield(r)),
                                              key=lambda r: r.arrival_seq)
            if not reqs:
                del left[v]
                continue
            yield reqs.pop()
            left[v] -= 1


def pick_next(classes: list[ClassQueue], excluded: set[Tenant], rank_of: Callable[[Request], int],
              skip_long: bool = False) -> tuple[Request, int] | None:
    """The waiting request admission tries next and its rank: the class of best rank
    (`rank_of` its earliest waiting request, then that request's arrival), and in it the
    request `ClassQueue.pick` chooses (`skip_long`: passing over long prompts); None if
    no class has a request outside `excluded`."""
    best: tuple[Request, int] | None = None
    best_key: tuple[int, int] | None = None
    for cq in classes:
        if not cq.num_waiting:
            continue
        picked = cq.pick(excluded, skip_long)
        if picked is None:
            continue
        req, oldest = picked
        key = (rank_of(oldest), oldest.arrival_seq)
        if best_key is None or key < best_key:
            best, best_key = (req, key[0]), key
    return best


def _yields(v: TenantQueue, num_running: int, tq: TenantQueue) -> bool:
    """The Yield rule: tenant `v`, holding `num_running` slots of the class, gives one to
    a waiting request of `tq` (see the module docstring)."""
    if v is tq or v.counter < tq.counter:
        return False
    share = num_running / v.tenant.weight
    after = (len(tq.running) + 1) / tq.tenant.weight
    return share >= YIELD_SHARE_FACTOR * after or (share > after and v.counter - tq.counter >= YIELD_LAG)


def _tie_first(tq: TenantQueue, seq: int, other: Request) -> bool:
    """Between two tenants of equal counter, the one with fewer running requests per
    weight goes first (a tenant just lifted to the level), then the earlier request (`seq`:
    the arrival of `tq`'s candidate)."""
    a, b = tq.share, other.share.share
    return a < b or (a == b and seq < other.arrival_seq)
