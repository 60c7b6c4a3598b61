"""Fleet-wide tenant limits: a tenant's token rate and its jobs held at once, enforced
across every worker of the consumer group through Redis, so N workers hold a tenant to
its limit and not to N times it (`serving_tuning.tenants[...].fleet_tokens_per_s`,
`fleet_burst_tokens`, `fleet_max_running`).

The idea is llm-d-async's `redis-quota` and the leased rates of API gateways: the fleet's
state lives in Redis, and each worker leases a share of it in advance, so admission is
decided locally, synchronously, and Redis is asked once per sync round (every
`SYNC_INTERVAL_S`, one script for every limited tenant the worker serves), never per job.
A tenant that arrives with nothing leased here asks for the round at once (no sooner than
`MIN_SYNC_GAP_S` after the last), so its first job does not wait out the interval.

**Token rate.** Each tenant has one token bucket in Redis (refilled at `fleet_tokens_per_s`
up to `fleet_burst_tokens`, on Redis's own clock). A worker with records of the tenant
waiting leases up to `LEASE_S` seconds of the rate from it into a local *allowance*. The
intake takes a record of the tenant only while its allowance is positive, and charges
it at once: its prompt tokens (counted exactly for token ids, estimated from the UTF-8
size for text until the tokenizer has run, then corrected) plus its `max_tokens`. The
allowance may go negative by that one charge (a job larger than the bucket still runs);
the debt is repaid from later leases. When the job ends, what it did not use (output
tokens not generated; the whole charge for a job that never ran) is given back. A worker
with nothing of the tenant waiting returns its allowance (or its debt) to the bucket.
The tokens the fleet starts in any window of T seconds are therefore at most the bucket's
size + T x rate, plus one job's charge per worker (the debts).

**Jobs held at once.** Per tenant a hash in Redis holds each worker's reserved slots. A
worker asks for as many as it holds plus has waiting (its local caps applied); the script
grants what the limit leaves after the other workers' reservations, never less than what
the worker already holds, atomically, so the fleet never passes the limit through a race.
"Holds" counts every record the worker has taken and not yet let go: jobs in its table,
records whose claims are in flight, and contested records (admitted once, they run here
with no new admission when their holder lets them go).
A worker that stops renewing (it died) loses its reservations after `RESERVATION_TTL_S`.

**Redis unreachable.** The limits fall back to per-worker shares: the rate and the bucket
divided by N, the slots `max(1, fleet_max_running // N)`, where N is the number of live
workers Redis counted at the last sync; one warning when that starts, one info line when
Redis answers again (the local surplus is then dropped, a debt kept). Nothing waits on
Redis: the intake reads only local state. A Redis that lost its data starts every
bucket full.

The engine's fair share between tenants (`fair_share.py`) stays local to each worker.

Writer: the intake's event loop (admission), the sync task (leases) and the job table's
release of a job (settlements), all on the worker's one asyncio thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from worker.obs.stopping import honour_cancellation
from worker.security.access import is_fatal_redis
from worker.security.redis import REDIS_DOWN
from worker.serve.input_size import input_bytes

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from worker.config import ServingTuning, TenantPolicy
    from worker.obs.metrics import Metrics
    from worker.serve.read_ahead import JobRecord

log = structlog.get_logger(__name__)

SYNC_INTERVAL_S = 0.1  # one script per this many seconds, for every limited tenant at once
MIN_SYNC_GAP_S = 0.01  # a round asked early (a tenant with nothing leased here) waits at least this long after the last
LEASE_S = 0.25  # a worker with records waiting leases up to this many seconds of a tenant's rate
RESERVATION_TTL_S = 3.0  # a worker's slots and its place in the live count lapse when it stops syncing
BYTES_PER_TOKEN_GUESS = 4  # a text prompt's tokens before the tokenizer ran: its UTF-8 bytes / this

# KEYS: live workers (zset), then per tenant: bucket (hash level, ts), slots (hash worker -> n),
#   slot leases (zset worker -> expiry ms).
# ARGV: worker id, ttl ms, then per tenant: rate (tokens/s, -1: none), burst, give (tokens back
#   to the bucket; negative: a debt), need (tokens wanted), cap (jobs, -1: none), want, held.
# Returns: {live workers, then per tenant: tokens granted, slots reserved (-1: no cap)}.
SYNC_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, ttl = ARGV[1], tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, me)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl * 10)
local out = {redis.call('ZCARD', KEYS[1])}
local n = (#KEYS - 1) / 3
for j = 0, n - 1 do
  local k, a = 1 + j * 3, 2 + j * 7
  local rate, burst = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local give, need = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local cap, want, held = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7])
  local granted = 0
  if rate >= 0 then
    local b = redis.call('HMGET', KEYS[k + 1], 'level', 'ts')
    local level, ts = tonumber(b[1]), tonumber(b[2])
    if level == nil or ts == nil then level, ts = burst, now end
    level = math.min(burst, math.min(burst, level + rate * math.max(0, now - ts) / 1000) + give)
    if need > 0 and level > 0 then  -- a reply's number is cast to a 64-bit integer: keep it well inside
      granted = math.floor(math.min(need, level, MAX_TOKENS))
      level = level - granted
    end
    redis.call('HSET', KEYS[k + 1], 'level', tostring(level), 'ts', now)
    redis.call('PEXPIRE', KEYS[k + 1], math.floor(math.min((burst - level) / rate * 1000, MAX_TTL_MS)) + ttl * 10)
  end
  local slots = -1
  if cap >= 0 then
    local hk, zk = KEYS[k + 2], KEYS[k + 3]
    for _, w in ipairs(redis.call('ZRANGEBYSCORE', zk, '-inf', now)) do redis.call('HDEL', hk, w) end
    redis.call('ZREMRANGEBYSCORE', zk, '-inf', now)
    local others, all = 0, redis.call('HGETALL', hk)
    for i = 1, #all, 2 do
      if all[i] ~= me then others = others + tonumber(all[i + 1]) end
    end
    slots = math.max(held, math.min(want, cap - others))
    if slots > 0 then
      redis.call('HSET', hk, me, slots)
      redis.call('ZADD', zk, now + ttl, me)
      redis.call('PEXPIRE', hk, ttl * 10)
      redis.call('PEXPIRE', zk, ttl * 10)
    else
      slots = 0
      redis.call('HDEL', hk, me)
      redis.call('ZREM', zk, me)
    end
  end
  out[#out + 1] = granted
  out[#out + 1] = slots
end
return out
""".replace("MAX_TOKENS", str(2**50)).replace("MAX_TTL_MS", str(2**40))  # 2^40 ms: 35 years

DENIAL_REASONS = ("tenant_cap", "fleet_tokens", "fleet_running")  # why a take round passed a tenant over


def workers_key(prefix: str) -> str:
    """Zset of the workers syncing fleet limits (member: worker id, score: expiry, Redis ms)."""
    return f"{prefix}:quota:workers"


def bucket_key(prefix: str, tenant: str) -> str:
    """Hash of a tenant's token bucket: `level` (tokens, may be negative), `ts` (Redis ms)."""
    return f"{prefix}:quota:{tenant}:bucket"


def slots_key(prefix: str, tenant: str) -> str:
    """Hash of a tenant's reserved slots per worker (jobs held at once)."""
    return f"{prefix}:quota:{tenant}:slots"


def slot_leases_key(prefix: str, tenant: str) -> str:
    """Zset of the workers holding a tenant's slots (score: expiry, Redis ms)."""
    return f"{prefix}:quota:{tenant}:leases"


@dataclass(slots=True)
class TenantShare:
    """What this worker holds of one tenant's fleet limits.

    Attributes:
        allowance: tokens leased and not yet charged (negative: a debt).
        slots: jobs of the tenant this worker may hold at once (None: no fleet cap).
    """

    allowance: float = 0.0
    slots: int | None = None


class FleetQuota:
    """The local side of the fleet-wide tenant limits (module docstring).

    Args:
        redis: the worker's Redis client.
        prefix: `redis.key_prefix`.
        worker_id: this worker's id (its reservations in Redis).
        tuning: `serving_tuning` (the tenants' policies).
        default_max_tokens: `max_tokens` of a job that names none (the engine's resolved
            `max_output_tokens`), for the charge taken before its input is processed.
        metrics: optional (`tenant_admission_denials_total`, `fleet_quota_fallback`).
        clock: monotonic clock (seconds), replaceable in tests.
    """

    def __init__(self, redis: Redis | None, prefix: str, worker_id: str, tuning: ServingTuning, *,
                 default_max_tokens: int, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.prefix = prefix
        self.worker_id = worker_id
        self.tuning = tuning
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics
        self.clock = clock
        self.shares: dict[str, TenantShare] = {}
        self.fallback = False  # Redis unreachable: per-worker shares of the limits
        self.live_workers = 1  # N of the fallback: live workers at the last sync
        self._refilled = clock()  # the fallback's last local refill
        self._wake = asyncio.Event()  # a tenant with nothing leased here is waiting: sync now
        self._last_sync = 0.0  # self.clock() when the last round was sent
        self._script: Any = redis.register_script(SYNC_LUA) if redis is not None else None

    # ---- admission (the intake, synchronously) --------------------------------------
    def blocked(self, tenant: str, held: int) -> str | None:
        """Why one more job of `tenant` may not be taken now (`fleet_tokens`,
        `fleet_running`), or None. `held`: its jobs held here, those taken this round
        included."""
        policy = self.tuning.tenant_policy(tenant)
        if not policy.fleet_limited:
            return None
        share = self.shares.get(tenant)
        if self.fallback:
            share = self._refill_local(tenant)
        elif share is None:  # nothing leased here yet: ask for the round now
            self._wake.set()
        if policy.fleet_tokens_per_s is not None and (share is None or share.allowance <= 0):
            return "fleet_tokens"
        if policy.fleet_max_running is not None:
            slots = self._fallback_slots(policy) if self.fallback else (share.slots if share is not None else 0)
            if held >= (slots or 0):
                return "fleet_running"
        return None

    def charge(self, rec: JobRecord) -> None:
        """Charge a record just taken: its prompt (estimated for text) plus its `max_tokens`."""
        policy = self.tuning.tenant_policy(rec.tenant)
        if policy.fleet_tokens_per_s is None:
            return
        job = rec.job
        prompt = (len(job.prompt_token_ids) if job.prompt_token_ids is not None
                  else input_bytes(job) // BYTES_PER_TOKEN_GUESS + 1)
        rec.charge = prompt + (job.params.max_tokens or self.default_max_tokens)
        self._share(rec.tenant).allowance -= rec.charge

    def correct(self, tenant: str, charged: int, exact: int) -> int:
        """The job's input is processed: its charge becomes `exact` (prompt tokens +
        resolved max_tokens). Returns the new charge."""
        if charged:
            self._share(tenant).allowance -= exact - charged
            return exact
        return 0

    def settle(self, tenant: str, charged: int, used: int) -> None:
        """A charged job leaves this worker (ended, handed back, or never opened): give
        back what it did not use (`used`: its prompt tokens if it reached the engine,
        plus the tokens it generated)."""
        if charged:
            self._share(tenant).allowance += charged - used

    def refund(self, rec: JobRecord) -> None:
        """A record charged at the intake that never became a job here (done, a duplicate,
        already running here, or dropped by a rebalance while contested): its whole charge
        back, once."""
        self.settle(rec.tenant, rec.charge, 0)
        rec.charge = 0

    # ---- the sync round (its own task) -----------------------------------------------
    async def run(self, waiting: Callable[[], Mapping[str, int]], held: Callable[[], Mapping[str, int]],
                  caps: Callable[[str], int]) -> None:
        """Sync every `SYNC_INTERVAL_S` until cancelled. `waiting`: records read ahead per
        tenant; `held`: jobs held per tenant; `caps`: a tenant's local cap of jobs."""
        while True:
            honour_cancellation()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SYNC_INTERVAL_S):
                    await self._wake.wait()
            gap = self._last_sync + MIN_SYNC_GAP_S - self.clock()
            if gap > 0:
                await asyncio.sleep(gap)
            self._wake.clear()
            try:
                await self.sync(waiting(), held(), caps)
            except REDIS_DOWN as e:
                if is_fatal_redis(e):
                    raise
                self._enter_fallback(e)

    async def sync(self, waiting: Mapping[str, int], held: Mapping[str, int], caps: Callable[[str], int]) -> None:
        """One round trip for every limited tenant with records waiting, jobs held, or a
        share to settle. Raises the Redis connection errors (the caller falls back)."""
        tenants = sorted(t for t in {*waiting, *held, *self.shares} if self.tuning.tenant_policy(t).fleet_limited)
        keys = [workers_key(self.prefix)]
        args: list[Any] = [self.worker_id, int(RESERVATION_TTL_S * 1000)]
        sent = []
        for t in tenants:
            policy = self.tuning.tenant_policy(t)
            share = self._share(t)
            n_wait, n_held = waiting.get(t, 0), held.get(t, 0)
            rate = policy.fleet_tokens_per_s
            give = need = 0.0
            if rate is not None and not self.fallback:
                if n_wait:
                    need = max(0.0, max(1.0, rate * LEASE_S) - share.allowance)
                else:
                    give = share.allowance  # a surplus back to the bucket, or a debt onto it
            cap = policy.fleet_max_running
            want = min(n_held + n_wait, caps(t)) if cap is not None else 0
            if cap is not None and share.slots is not None:  # slots this round may give away: not taken meanwhile
                share.slots = min(share.slots, max(want, n_held))
            keys += [bucket_key(self.prefix, t), slots_key(self.prefix, t), slot_leases_key(self.prefix, t)]
            args += [-1 if rate is None else rate, _burst(policy), give, math.ceil(need),
                     -1 if cap is None else cap, want, n_held]
            sent.append((t, give))
        self._last_sync = self.clock()
        out = await self._script(keys=keys, args=args)
        if self.fallback:  # Redis answers again: the surplus refilled locally is not the fleet's
            for share in self.shares.values():
                share.allowance = min(share.allowance, 0.0)
            self.fallback = False
            log.info("fleet tenant limits are kept through Redis again", live_workers=int(out[0]))
            if self.metrics is not None:
                self.metrics.quota.fallback.set(0)
        self.live_workers = max(1, int(out[0]))
        for i, (t, give) in enumerate(sent):
            share = self.shares[t]
            share.allowance += int(out[1 + 2 * i]) - give
            slots = int(out[2 + 2 * i])
            share.slots = None if slots < 0 else slots
            if not share.allowance and not share.slots and not waiting.get(t) and not held.get(t):
                del self.shares[t]

    async def release(self) -> None:
        """A clean stop: give back this worker's slots and allowance now (one round with
        nothing waiting or held) instead of letting its slots lapse after
        `RESERVATION_TTL_S`. Raises the Redis errors (the caller bounds and logs them)."""
        if self.shares and not self.fallback:
            await self.sync({}, {}, lambda t: 0)

    # ---- fallback ---------------------------------------------------------------------
    def _enter_fallback(self, error: BaseException) -> None:
        if self.fallback:
            return
        self.fallback = True
        self._refilled = self.clock()
        log.warning("Redis unreachable: fleet tenant limits fall back to this worker's share (limit / live "
                    "workers)", live_workers=self.live_workers, error=repr(error)[:200])
        if self.metrics is not None:
            self.metrics.quota.fallback.set(1)

    def _refill_local(self, tenant: str) -> TenantShare:
        """The fallback's local buckets: each rate and bucket divided by N, every tenant
        refilled for the time since the last refill (whichever tenant asks)."""
        share = self._share(tenant)
        now = self.clock()
        dt, self._refilled = now - self._refilled, now
        n = self.live_workers
        for t, s in self.shares.items():  # every tenant refills by the same elapsed time
            p = self.tuning.tenant_policy(t)
            if p.fleet_tokens_per_s is not None:
                s.allowance = min(_burst(p) / n, s.allowance + p.fleet_tokens_per_s / n * dt)
        return share

    def _fallback_slots(self, policy: TenantPolicy) -> int:
        return max(1, policy.fleet_max_running // self.live_workers)

    def _share(self, tenant: str) -> TenantShare:
        share = self.shares.get(tenant)
        if share is None:
            share = self.shares[tenant] = TenantShare()
        return share


def _burst(policy: TenantPolicy) -> float:
    """A tenant's bucket size in tokens (`fleet_burst_tokens`, default one second of rate)."""
    if policy.fleet_tokens_per_s is None:
        return 0.0
    return float(policy.fleet_burst_tokens or max(1.0, policy.fleet_tokens_per_s))


def fleet_limits_configured(tuning: ServingTuning) -> bool:
    """Whether any tenant policy (listed, or the default) sets a fleet-wide limit."""
    return tuning.default_tenant.fleet_limited or any(p.fleet_limited for p in tuning.tenants.values())
