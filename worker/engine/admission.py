"""The admission phase of a step (phase 2 of `Scheduler.schedule`): waiting requests into
the batch, best class rank first, tenant share inside a class, bounded skipping. The
rules are those of the scheduler's module docstring; each is stated again beside its
branch here.

`StepPlan` is what a step has decided so far (both phases write it); `AdmissionPass`
owns what only the admission phase keeps: the requests it passed over this step and
why. Both live for one `schedule()` call. They write request status and progress on
the scheduler's behalf (the scheduler stays their only caller), and only through the
scheduler's own methods for the queues and the running list.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from worker.config import ServingTuning
from worker.engine.fair_share import ClassQueue, Tenant, pick_next
from worker.engine.kv_cache import KVCacheManager
from worker.engine.lora_slots import LoRASlots
from worker.engine.request import Request, RequestStatus
from worker.engine.tiering import LongPrefillCap

# Blocked waiting requests one step passes over before it stops admitting (bounds its cost).
MAX_SKIPPED_PER_STEP = 64


@dataclass(slots=True)
class StepPlan:
    """One step's decisions so far: the token budget left, the tokens of each request in
    the batch (request id -> tokens), the requests it preempted (ids) and admitted (ids),
    and the drafts of speculating decodes (request id -> guesses; their tokens in
    `scheduled` are 1 + len(draft))."""

    budget: int
    scheduled: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    admitted: set[str] = field(default_factory=set)
    drafts: dict[str, list[int]] = field(default_factory=dict)


class Scheduler(Protocol):
    """What admission uses of its scheduler (`worker.engine.scheduler.Scheduler`)."""

    tuning: ServingTuning
    kv: KVCacheManager
    loras: LoRASlots | None
    classes: list[ClassQueue]  # the waiting requests, one queue per priority class
    running: list[Request]  # sorted by (effective_rank, arrival_seq)
    long_prefills: LongPrefillCap
    fair: bool  # tenant fair share inside a class
    may_yield: bool  # this step may take a slot back from a tenant over its share

    def effective_rank(self, req: Request) -> int: ...

    def reserve_tokens(self, req: Request) -> int: ...

    def make_room(self, req: Request, rank: int, num_blocks: int, plan: StepPlan) -> int | None: ...

    def pop_waiting(self, req: Request) -> None: ...

    def push_waiting(self, req: Request) -> None: ...

    def add_running(self, req: Request) -> None: ...


class AdmissionPass:
    """One step's admission of waiting requests.

    Args:
        sched: the scheduler (its queues, running list, KV manager, rank function).
        plan: the step's plan after its running phase (no preemption in it).
    """

    def __init__(self, sched: Scheduler, plan: StepPlan) -> None:
        self.sched = sched
        self.plan = plan
        self.skipped: list[Request] = []  # could not get a slot or blocks; passed by later ones
        self.skipped_rank: int | None = None  # the rank of the last one skipped
        self.excluded: set[Tenant] = set()  # tenants at a cap or quota this step: their requests wait
        self.over_quota: list[Request] = []  # their tenant is at its KV quota
        self.deferred: list[Request] = []  # past the long-prefill cap, or their adapter is loading

    def run(self) -> None:
        """Admit while the budget lasts; the requests passed over wait again, in place."""
        s, plan, longs = self.sched, self.plan, self.sched.long_prefills
        while plan.budget > 0:
            # once the step's long-prefill cap is spent, the long prompts waiting are passed over together
            found = pick_next(s.classes, self.excluded, s.effective_rank, skip_long=longs.is_spent)
            if found is None:
                break
            req, rank = found
            if self.skipped_rank is not None and rank > self.skipped_rank:
                break  # nothing passes a blocked request of a better rank (it would preempt that one)
            tenant = req.share.tenant
            if tenant.is_at_running_cap:
                self.excluded.add(tenant)
                continue
            if self._no_slot(req, rank):
                break  # no slot and none to take: nothing ranked behind can start either
            if req.num_in_flight_steps:  # preempted while a step computed for it: it holds the
                break  # reservation until that step is applied (its stream's tokens all known)
            if req.adapter is not None and (held := s.loras.hold(req, self.skipped, self.deferred)) is not None:
                s.pop_waiting(req)  # its adapter is loading, or blocked (lora_slots.py)
                if held:
                    break  # it holds the reservation: the batch's adapters drain until it fits
                continue
            s.pop_waiting(req)  # before any victim is requeued (aging can rank a victim ahead of it)
            if not self._try(req, rank):
                break
        if longs.is_spent and plan.budget > 0:
            longs.passed_over(sum(cq.num_waiting_long for cq in s.classes))
        for req in self.skipped + self.over_quota + self.deferred:
            s.push_waiting(req)

    def _no_slot(self, req: Request, rank: int) -> bool:
        """The batch is full of requests ranked no worse, and fair share's Yield (a
        tenant over its share gives a slot back) does not apply."""
        s = self.sched
        return (len(s.running) >= s.tuning.max_running_requests and s.running[-1].effective_rank <= rank
                and not (s.may_yield and s.classes[req.priority].may_yield(req.share)))

    def _try(self, req: Request, rank: int) -> bool:
        """Admit `req` if it can get its blocks (and a slot), preempting what
        `Scheduler.make_room` chooses; else set it aside. False: stop admitting."""
        s, plan, kv = self.sched, self.plan, self.sched.kv
        longs = s.long_prefills
        if longs.defers(req):  # the step's long-prefill cap is gone: it starts in a later step
            self.deferred.append(req)
            return True
        is_long = longs.is_long(req)
        cached_blocks = kv.find_cached_prefix(req)
        num_computed = len(cached_blocks) * kv.block_size
        num_prefill = req.num_tokens - num_computed
        limit = longs.chunk(min(num_prefill, plan.budget)) if is_long else None  # >= 1: the cap has some left
        reserve = s.reserve_tokens(req)
        tenant = req.share.tenant
        if tenant.max_kv_blocks is not None and (kv.num_blocks_held(tenant.name) + kv.table_growth(
                req, num_prefill, cached_blocks, reserve) > tenant.max_kv_blocks):
            self.excluded.add(tenant)  # at its KV quota: its requests wait, others start, no skip counted
            self.over_quota.append(req)
            return True
        given_back = s.make_room(req, rank, kv.num_blocks_to_admit(req, num_prefill, cached_blocks, reserve), plan)
        room = plan.budget + (given_back or 0)
        num_alloc = kv.admission_tokens(num_prefill, min(room, limit) if limit else room)
        if given_back is None or not kv.allocate(req, num_alloc, cached_blocks, reserve_tokens=reserve):
            self.skipped.append(req)
            # bounded skipping: a preempted request, or one passed max_admission_skips times,
            # holds a reservation; nothing ranked behind it is admitted until it is
            if (req.status == RequestStatus.PREEMPTED or req.num_skips >= s.tuning.max_admission_skips
                    or len(self.skipped) > MAX_SKIPPED_PER_STEP):
                return False
            self.skipped_rank = rank
            return True
        plan.budget += given_back
        self._start(req, rank, num_computed)
        num_new = plan.scheduled[req.request_id] = min(num_prefill, plan.budget, limit or plan.budget)
        plan.budget -= num_new
        if limit:
            longs.spend(num_new)
        for r in self.skipped:
            r.num_skips += 1
        return not any(r.num_skips >= s.tuning.max_admission_skips for r in self.skipped)

    def _start(self, req: Request, rank: int, num_computed: int) -> None:
        """`req` got its blocks: RUNNING at `rank`, its prefix-cache hit counted."""
        s = self.sched
        if req.status == RequestStatus.WAITING:  # first admission (not a re-admission)
            req.num_cached_tokens = num_computed
            req.first_scheduled_time = time.time()
            if s.fair:  # VTC charges the prompt at admission (its computed tokens only)
                req.share.counter += (req.num_prompt_tokens - num_computed) * req.share.prefill_cost
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        req.effective_rank = rank
        req.num_skips = 0
        s.add_running(req)
        self.plan.admitted.add(req.request_id)
