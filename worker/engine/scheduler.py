"""Iteration-level scheduler (ORCA, OSDI '22) with chunked prefill and preemption by
recompute (vLLM, SOSP '23).

Every step builds one packed batch under `max_batched_tokens`:
  1. running requests, decodes first, then unfinished prefill chunks, in rank order;
  2. waiting requests, best class rank first and, inside a class, by tenant share
     (below), while slots, budget and blocks allow. None in a step that preempted in 1
     (as vLLM V1), so a victim is never re-admitted in the step it lost its blocks.
A request leaves the batch the step it finishes; its slot is filled the next step.

With `serving_tuning.long_prefill_threshold`, long prompts' prefill chunks share a
per-step cap in 1 and 2 alike (tiering.py: prompt-length tiering).

With `serving_tuning.speculative`, a decode in 1 may carry a draft of up to k guesses
(speculative.py): 1 + k tokens of the budget, blocks for all of them if that leaves a
free block per running request (else it decodes plainly: a guess never makes anyone
preempt), tenants charged for every position.

Classes, aging and tenants. A class's rank is its priority minus one per
`priority_aging_steps` its earliest waiting request has waited; the class of best rank
(then earliest request) admits next, and the request admitted holds that rank while it
runs. Inside the class the request is chosen by tenant share (fair_share.py: the
Virtual Token Counter of Sheng et al., OSDI 2024, with its lift; `fair_share: false`
or a single tenant: the earliest request, as before). So aging orders classes and never
tenants: a flooding tenant's old requests age their class, not themselves past other
tenants of it; and fairness orders tenants and never classes. A tenant at one of its
quotas (`serving_tuning.tenants`) is passed over: its requests wait, others start, and
nothing counts as a skip.

Rules under KV pressure (each one closes a loop seen in practice):
  - Admission allocates blocks for the whole remaining prefill (prompt + output so
    far), not for the first chunk only (vLLM #21793): a long prompt is not started on
    a chunk that fits only to lose its blocks before its prefill ends. So only a
    decode ever asks for a new block. (A model windowed in every layer admits on the
    peak its window allows and allocates chunk by chunk, freeing behind: kv_window.py.) Under `kv_policy: reserve`, and for a request
    preempted RESERVE_AFTER_PREEMPTIONS times already, it allocates prompt +
    max_tokens: such a request never asks for a block again.
  - Victims (preemption.py): a decode that finds no free block preempts the running
    request of the lowest rank (then most-served tenant, latest arrival), passing over
    those that hold prompt + max_tokens; a waiting request may preempt requests of a
    strictly worse rank, then by fair share's Yield, only when that makes it fit.
  - Preempted first: a preempted request is picked before every request of its class
    that has not started (fair_share.py: Resume first, unless its tenant owes the slot
    by Yield) and, when it cannot get its slot or blocks back, holds the reservation at
    once (no skips): nothing ranked behind it is admitted until it is. So it resumes in
    the first step whose admission phase finds its blocks free (the next one if that
    step preempted), and no later arrival of its class starts before it.
  - Bounded skipping: a waiting request that cannot get a slot or its blocks is
    passed by requests of the *same* rank picked after it that can, at most
    `max_admission_skips` admissions in all; then it holds a reservation and nothing
    ranked behind it is admitted until it is. Nothing of a worse rank passes it: it
    would preempt such a request as soon as preempting could make it fit, wasting the
    work. With N = max_admission_skips, a blocked request starts once the requests
    running when its N-th pass happened have freed enough blocks. A request whose LoRA
    adapter is loading waits without a skip; one kept out by `max_loras_per_batch`
    counts skips alike (lora_slots.py).

The Scheduler is the only writer of request status and progress, and the only caller
of the KVCacheManager. The engine thread owns it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from worker.config import ServingTuning
from worker.engine.admission import AdmissionPass, StepPlan
from worker.engine.batch import apply_batch, build_batch
from worker.engine.fair_share import ClassQueue, Tenant
from worker.engine.kv_cache import KVCacheManager
from worker.engine.lora_slots import LoRASlots
from worker.engine.outputs import ModelRunnerOutput, SchedulerOutput
from worker.engine.preemption import RESERVE_AFTER_PREEMPTIONS, room_victims, victim_for
from worker.engine.request import Priority, Request, RequestStatus
from worker.engine.speculative import Speculation
from worker.engine.tiering import LongPrefillCap


def _rank_key(req: Request) -> tuple[int, int]:
    return (req.effective_rank, req.arrival_seq)


class Scheduler:
    def __init__(self, tuning: ServingTuning, kv: KVCacheManager, loras: LoRASlots | None = None) -> None:
        self.tuning = tuning
        self.kv = kv
        self.loras = loras  # LoRA adapters: resident, pinned, loading (lora_slots.py); None: no LoRA
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []  # sorted by (effective_rank, arrival_seq)
        self.long_prefills = LongPrefillCap(tuning)
        self.classes = [ClassQueue(p, tuning, self.long_prefills.is_long) for p in Priority]
        self.tenants: dict[str, Tenant] = {}  # tenants with a request here
        self.fair = tuning.fair_share
        self._kv_quotas = tuning.default_tenant.max_kv_blocks is not None or any(
            t.max_kv_blocks is not None for t in tuning.tenants.values())
        self.step_count = 0
        self.num_preemptions_total = 0
        self._num_freed = 0  # running requests that left the batch since the last schedule()
        # steps run ahead (EngineCore's asynchronous steps): requests may owe tokens to a step in flight
        self.steps_ahead = False
        self.copy_block_tables = False  # and the KV manager changes tables in place: snapshot them
        self.may_yield = False  # this step: no slot freed since the last one (fair_share Yield)
        # the proposer of speculative decoding; the engine core turns it off where its runner cannot verify
        self.speculation = Speculation(tuning.speculative) if tuning.speculative.enabled else None

    # ---- queries -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return sum(c.num_waiting for c in self.classes)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- mutations from the engine ---------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        req.arrival_step = self.step_count
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        tenant = self.tenants.get(req.tenant)
        if tenant is None:
            tenant = self.tenants[req.tenant] = Tenant(req.tenant, self.tuning.tenant_policy(req.tenant))
        tenant.num_requests += 1
        req.share = self.classes[req.priority].join(tenant, self.step_count)
        self.push_waiting(req)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string, error): free its blocks now.

        Returns the request, or None if the id is unknown or already finished (no-op).
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        cq = self.classes[req.priority]
        if req.status == RequestStatus.RUNNING:
            self._remove_running(req)
        else:  # waiting or preempted
            cq.remove(req)
        self.kv.free(request_id)
        req.status = status
        if self.speculation is not None:
            self.speculation.finished(req)
        tenant = req.share.tenant
        tenant.num_requests -= 1
        if not tenant.num_requests:
            del self.tenants[tenant.name]
        cq.leave_if_idle(req.share, self.step_count)
        return req

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request by recompute (used after a failed step). False if
        it is not running."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.RUNNING:
            return False
        self._preempt(req, {}, "oom")
        return True

    # ---- the step ------------------------------------------------------------------
    def effective_rank(self, req: Request) -> int:
        """Priority class minus one per `priority_aging_steps` the request has waited
        (lower is served first); a class's rank is that of its earliest waiting request."""
        return int(req.priority) - (self.step_count - req.arrival_step) // self.tuning.priority_aging_steps

    def schedule(self, max_batched_tokens: int | None = None) -> SchedulerOutput:
        """Build the next step's batch (rules in the module docstring): the running
        requests first, then, unless that preempted, the waiting ones (`AdmissionPass`).
        `max_batched_tokens` lowers the step's token budget below
        `tuning.max_batched_tokens` (the engine's back-off after an OOM)."""
        self.step_count += 1
        # A Yield only in a step after one that freed no slot: while requests end, Pick
        # hands the next free slot to the tenant behind within a step, without recompute.
        self.may_yield = self.fair and self._num_freed == 0
        self._num_freed = 0
        limit = self.tuning.max_batched_tokens
        plan = StepPlan(min(max_batched_tokens or limit, limit))
        self.long_prefills.start_step()
        self._schedule_running(plan)
        if not plan.preempted:  # as vLLM V1: a victim is never re-admitted in the step it lost its blocks
            AdmissionPass(self, plan).run()
        out = build_batch(self.step_count, plan.scheduled, self.requests, self.kv.block_table,
                          self.copy_block_tables, self.loras.resident if self.loras else None, plan.drafts)
        if out.num_scheduled_tokens:  # an empty step runs nothing: its copies wait for the next
            out.kv_copies = self.kv.take_copies()
        return out

    def _schedule_running(self, plan: StepPlan) -> None:
        """Phase 1: decodes first, then continuing prefill chunks, each in rank order; a
        request that finds no free block preempts a victim (`preemption.victim_for`), and
        one over its tenant's KV quota preempts inside that tenant."""
        if not self.steps_ahead and self.speculation is None and not self._kv_quotas:
            # plain decodes and no step in flight owing anyone a token: one pass
            for req in self._schedule_decodes(self.running[:], plan, classify=True):
                self._schedule_one(req, plan, None)
            return
        decodes: list[Request] = []
        prefills: list[Request] = []
        ending: list[Request] = []
        for r in self.running:
            num_placeholders = r.num_output_placeholders
            num_tokens = len(r.all_token_ids) + num_placeholders
            if num_placeholders:  # a step in flight owes it a token
                if num_tokens - r.num_prompt_tokens >= r.max_tokens:
                    ending.append(r)  # its last: it ends now, and the step in flight delivers it
                    continue
                if r.grammar is not None:
                    continue  # its mask needs that token: it sits this step out
            (decodes if num_tokens - r.num_computed_tokens == 1 else prefills).append(r)
        for r in ending:
            self.finish(r.request_id, RequestStatus.FINISHED_LENGTH)
        spec = self.speculation
        if spec is not None and not spec.active(len(self.running)):
            spec = None
        if spec is None and not self._kv_quotas:
            self._schedule_decodes(decodes, plan)
        else:
            for req in decodes:
                self._schedule_one(req, plan, spec)
        for req in prefills:
            self._schedule_one(req, plan, None)

    def _schedule_decodes(self, reqs: list[Request], plan: StepPlan, classify: bool = False) -> list[Request]:
        """Plain decodes (no speculation, no KV quotas): a token each, `_schedule_one`'s
        rules without the ones that cannot apply to them; most find their block table
        already covers the new token (`KVCacheManager.allocate`'s fast path). `classify`:
        `reqs` is the running batch (a copy: preempting changes it) and only those with
        one token to compute are decodes; the others are returned, in order, for their
        prefill chunks (none once the budget is spent). This loop runs for every running
        request every step: keep it lean (host time per step)."""
        running = RequestStatus.RUNNING
        scheduled = plan.scheduled
        allocate = self.kv.allocate
        # a table that only grows covers the decode when its last block has room (`allocate`'s first answer)
        tables = None if self.kv.changes_tables_in_place else self.kv.tables
        bs = self.kv.block_size
        reserve_all = self.tuning.kv_policy == "reserve"
        rest: list[Request] = []
        for req in reqs:
            if classify and len(req.all_token_ids) - req.num_computed_tokens != 1:
                rest.append(req)
                continue
            if req.status != running:
                continue  # preempted by one ranked before it this step
            if plan.budget == 0:
                return []  # nothing more this phase
            reserve = (req.num_prompt_tokens + req.max_tokens
                       if reserve_all or req.num_preemptions >= RESERVE_AFTER_PREEMPTIONS else 0)
            table = tables.get(req.request_id) if tables is not None else None
            covered = table is not None and req.num_computed_tokens < len(table) * bs and reserve <= len(table) * bs
            if covered or allocate(req, 1, reserve_tokens=reserve):
                scheduled[req.request_id] = 1
                plan.budget -= 1
            else:
                self._schedule_one(req, plan, None)  # preempts until it fits or is the victim
        return rest

    def _schedule_one(self, req: Request, plan: StepPlan, spec: Speculation | None) -> None:
        """Schedule running `req`'s next chunk (a decode, with a draft when `spec` gives
        one, or a prefill chunk under the long-prefill cap), preempting victims while its
        blocks do not fit or its tenant is over its KV quota."""
        if req.status != RequestStatus.RUNNING or plan.budget == 0:
            return  # preempted by one ranked before it this step, or no budget left
        num_new = min(len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens, plan.budget)
        if spec is not None and num_new == 1 and self._speculate(req, spec, plan):
            return
        longs = self.long_prefills
        is_long = num_new > 1 and longs.is_long(req)
        if is_long:
            num_new = longs.chunk(num_new)
            if num_new == 0:
                return  # the cap is spent: it keeps its blocks and goes on next step
        while True:  # only a decode asks for a new block: admission allocated the whole prefill
            if self._kv_quotas and self._over_kv_quota(req, num_new):
                victim = self._victim_for(req, req.share.tenant)
                why = "kv_quota"
            elif self.kv.allocate(req, num_new, reserve_tokens=self.reserve_tokens(req)):
                plan.scheduled[req.request_id] = num_new
                plan.budget -= num_new
                if is_long:
                    longs.spend(num_new)
                return
            else:
                victim = self._victim_for(req)
                why = "kv_full"
            plan.budget += self._preempt(victim, plan.scheduled, why)
            plan.preempted.append(victim.request_id)
            if victim is req:
                return

    def _speculate(self, req: Request, spec: Speculation, plan: StepPlan) -> bool:
        """Schedule decode `req` with a draft if it has one, its 1 + k tokens fit its
        tenant's KV quota, and the blocks the guesses add leave a free block per running
        request (so guesses never make a plain decode preempt); False: it was not
        scheduled (it decodes plainly)."""
        draft = spec.propose(req, self.step_count, plan.budget - 1)
        if not draft:
            return False
        num_new = 1 + len(draft)
        if self._kv_quotas and self._over_kv_quota(req, num_new):
            return False
        reserve = self.reserve_tokens(req)
        extra = self.kv.table_growth(req, num_new, reserve_tokens=reserve) - self.kv.table_growth(
            req, 1, reserve_tokens=reserve)
        if extra and self.kv.num_free_blocks - extra < len(self.running):
            return False
        if not self.kv.allocate(req, num_new, reserve_tokens=reserve):
            return False
        plan.scheduled[req.request_id] = num_new
        plan.drafts[req.request_id] = draft
        plan.budget -= num_new
        return True

    def update_from_output(self, out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[tuple[Request, int]]:
        """Apply a step whose forward succeeded (`batch.apply_batch`). Returns the requests
        that got tokens, each with how many."""
        return apply_batch(out, runner_out, self.kv, self.fair, self.finish, self.speculation)

    # ---- helpers -------------------------------------------------------------------
    def reserve_tokens(self, req: Request) -> int:
        """Tokens the request's blocks must cover from admission on: prompt + max_tokens
        under `kv_policy: reserve` or once it has been preempted RESERVE_AFTER_PREEMPTIONS
        times; else 0 (optimistic)."""
        if self.tuning.kv_policy == "reserve" or req.num_preemptions >= RESERVE_AFTER_PREEMPTIONS:
            return req.num_prompt_tokens + req.max_tokens
        return 0

    def _over_kv_quota(self, req: Request, num_new: int) -> bool:
        """A running request's next chunk would take its tenant past `max_kv_blocks`."""
        tenant = req.share.tenant
        if tenant.max_kv_blocks is None:
            return False
        growth = self.kv.table_growth(req, num_new, reserve_tokens=self.reserve_tokens(req))
        return growth > 0 and self.kv.num_blocks_held(tenant.name) + growth > tenant.max_kv_blocks

    def add_running(self, req: Request) -> None:
        """`req` joins the running batch (rank order; its adapter pinned; its tenant's count)."""
        if req.adapter is not None:
            req.lora_slot = self.loras.pin(req.adapter)
        bisect.insort(self.running, req, key=_rank_key)
        req.share.running[req.request_id] = req
        req.share.tenant.num_running += 1

    def _remove_running(self, req: Request) -> None:
        i = bisect.bisect_left(self.running, _rank_key(req), key=_rank_key)
        while self.running[i] is not req:
            i += 1
        del self.running[i]
        if req.adapter is not None:
            self.loras.unpin(req.adapter)
            req.lora_slot = -1
        del req.share.running[req.request_id]
        req.share.tenant.num_running -= 1
        self._num_freed += 1

    def _preempt(self, victim: Request, scheduled: dict[str, int], reason: str) -> int:
        """Free the victim's KV and requeue it at its original place. Returns the
        token budget it gave back if it had been scheduled this step. `reason` (`kv_full`,
        `kv_quota`, `admission`, `oom`) goes into a traced request's events."""
        victim.note("preempted", victim.num_computed_tokens, reason)
        self._remove_running(victim)
        self.kv.free(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self.push_waiting(victim)
        return scheduled.pop(victim.request_id, 0)

    def _victim_for(self, req: Request, tenant: Tenant | None = None) -> Request:
        return victim_for(self.running, req, lambda r: bool(self.reserve_tokens(r)), self.fair, tenant)

    def make_room(self, req: Request, rank: int, num_blocks: int, plan: StepPlan) -> int | None:
        """Give waiting `req` (of `rank`) a slot and `num_blocks` free blocks by
        preempting what `preemption.room_victims` chooses (never a request `plan`
        admitted this step). Preempts nothing and returns None if that cannot be done;
        else the token budget the victims gave back."""
        cq = self.classes[req.priority]
        yield_victims = None
        if self.may_yield and cq.may_yield(req.share):
            def can_yield(r: Request) -> bool:
                return r.effective_rank == rank and r.request_id not in plan.admitted and not self.reserve_tokens(r)

            def yield_victims() -> Iterable[Request]:
                return cq.yield_victims(req.share, can_yield)
        victims = room_victims(self.running, rank, num_blocks, self.kv.num_free_blocks,
                               self.tuning.max_running_requests - len(self.running),
                               lambda r: self.kv.num_freeable_blocks(r.request_id), self.fair, yield_victims)
        if victims is None:
            return None
        given_back = 0
        for victim in victims:
            given_back += self._preempt(victim, plan.scheduled, "admission")
            plan.preempted.append(victim.request_id)
        return given_back

    def pop_waiting(self, req: Request) -> None:
        """`req` leaves its class's waiting queue (admission is trying it)."""
        self.classes[req.priority].pop(req)

    def push_waiting(self, req: Request) -> None:
        """`req` waits (again) in its class's queue, at its place."""
        self.classes[req.priority].push(req)
