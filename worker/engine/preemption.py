"""Who is preempted when blocks or slots run out: the victim policy of the scheduler
(preemption by recompute, vLLM SOSP '23), as pure functions over the running list. The
scheduler (`scheduler.py`) preempts what these choose; nothing here changes state.

  - Victim, when a decode finds no free block (`victim_for`): the running request of
    the lowest rank, then of the most-served tenant (fair share on), then latest
    arrival, passing over those that hold prompt + max_tokens unless they rank strictly
    below the decode's request; the request itself if no other qualifies. Hence, without
    priority changes (classes and aging), no request is preempted more than
    RESERVE_AFTER_PREEMPTIONS times for want of blocks, by a tenant's KV quota or by a
    Yield (the engine's out-of-memory retries are outside this rule). A decode whose
    tenant is at its `max_kv_blocks` takes its victim the same way among its tenant's
    requests.
  - Room for a waiting request (`room_victims`): running requests of a strictly worse
    rank, lowest first, and then, by fair share's Yield, same-rank requests of tenants
    over their share; only when that gives it both a slot and its blocks, else nobody.
    Requests admitted in the same step are never its victims: admission goes in rank
    order, so they rank no worse than it (and a Yield skips them explicitly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from worker.engine.fair_share import Tenant
from worker.engine.request import Request

RESERVE_AFTER_PREEMPTIONS = 2
"""A request preempted this many times holds prompt + max_tokens from its next admission."""


def victim_key(req: Request, fair: bool) -> tuple[int, float, int]:
    """Larger = preempted first: worse rank, then more-served tenant (fair share), then
    later arrival."""
    return (req.effective_rank, req.share.counter if fair else 0.0, req.arrival_seq)


def victim_for(running: list[Request], req: Request, holds_reserve: Callable[[Request], bool], fair: bool,
               tenant: Tenant | None = None) -> Request:
    """The request to preempt when running `req` needs a block.

    Args:
        running: the running requests, sorted by (effective rank, arrival).
        req: the request that needs a block.
        holds_reserve: whether a request holds prompt + max_tokens (never asks again).
        fair: fair share on (the tenant counter orders victims of one rank).
        tenant: only among that tenant's requests (its KV quota).

    Returns:
        A running request, or `req` itself if none qualifies.
    """
    best, best_key = req, victim_key(req, fair)
    for victim in reversed(running):
        if victim.effective_rank < best.effective_rank:
            break  # ranks only get better from here
        if victim is req or (tenant is not None and victim.share.tenant is not tenant):
            continue
        if victim.effective_rank <= req.effective_rank and holds_reserve(victim):
            continue
        key = victim_key(victim, fair)
        if key > best_key:
            best, best_key = victim, key
    return best


def room_victims(running: list[Request], rank: int, num_blocks: int, num_free: int, num_slots: int,
                 freeable: Callable[[Request], int], fair: bool,
                 yield_victims: Callable[[], Iterable[Request]] | None = None) -> list[Request] | None:
    """The running requests to preempt so a waiting request of `rank` gets a slot and
    `num_blocks` free blocks.

    Args:
        running: the running requests, sorted by (effective rank, arrival).
        rank: the waiting request's effective rank.
        num_blocks: KV blocks it needs; `num_free`, `num_slots`: free now.
        freeable: blocks preempting a request would free (shared prefix blocks stay).
        fair: fair share on.
        yield_victims: the same-rank requests fair share's Yield offers, in its order,
            taken after every worse-ranked one; called only if those are not enough.

    Returns:
        The victims (empty if it fits already), or None if even all of them would not
        make it fit: then nobody is preempted.
    """
    if num_free >= num_blocks and num_slots > 0:
        return []
    victims: list[Request] = []
    worse = []
    for victim in reversed(running):
        if victim.effective_rank <= rank:
            break
        worse.append(victim)
    if fair:
        worse.sort(key=lambda r: victim_key(r, fair), reverse=True)
    for victim in worse:
        if num_free >= num_blocks and num_slots > 0:
            break
        num_free += freeable(victim)
        num_slots += 1
        victims.append(victim)
    if (num_free < num_blocks or num_slots <= 0) and yield_victims is not None:
        for victim in yield_victims():
            if num_free >= num_blocks and num_slots > 0:
                break
            num_free += freeable(victim)
            num_slots += 1
            victims.append(victim)
    if num_free < num_blocks or num_slots <= 0:
        return None
    return victims
