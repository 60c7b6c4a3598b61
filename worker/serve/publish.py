"""Event publishing to Redis: one script call per round, whatever the number of events.

The publisher is the one task that writes events. Each round it takes every event the
job table has drafted since the last round (`JobTable.drain`: per job the opening events,
one merged `token` event, the terminal one) and sends them in one EVALSHA of
`APPEND_LUA`, which for every event:

    XADD   inflight:job:{id}:log  (replay; capped, TTL refreshed when half gone)
    PUBLISH inflight:job:{id}     (live)

(`inflight:t:{tenant}:job:{id}…` for a job with a tenant: `Round.tenants`, `schemas.keys`),

unless the log already holds that `seq` or a later one (idempotent: a round re-sent after
a connection error, or an event from a worker that lost the job's lease, never
duplicates or reorders entries), and for a terminal event also sets the done mark,
releases the claim and clears the attempt's failure mark (`claims.FINISH_LUA`). When
the publisher falls behind the engine (a slow Redis, a burst), rounds simply carry more
tokens per event: fewer, larger deltas, the same text (token coalescing).

Outages: a round that cannot reach Redis is retried with backoff while the engine keeps
running its jobs (their tokens keep merging into the drafts) and intake pauses; after
`redis.outage_limit_s` without Redis the publisher gives up (`RedisUnavailable`) and the
worker exits promptly so its partitions move. Data loss: if Redis restarted empty (the
epoch marker is gone, see `claims.py`), `restore` re-claims the held jobs and re-appends
every event each of them (and each recently finished job) already published, with the
same seqs, before anything new is written, so a log read from its first entry still
reassembles to the final text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import NoScriptError, ResponseError

from schemas import keys
from schemas.wire import Finished
from worker.config import RedisConfig
from worker.security.access import is_fatal_redis
from worker.security.redis import REDIS_DOWN, RedisUnavailable
from worker.serve.claims import FINISH_LUA, LAST_SEQ, ClaimStore, EpochChanged
from worker.serve.jobs import JobTable, Round

log = structlog.get_logger(__name__)

# KEYS: epoch, then per event: log, channel (+ done, claim, failures for a terminal event).
# ARGV: epoch, maxlen, ttl, then per event: kind ('t' token, 'o' other, 'f' terminal), data, seq
# (+ reason, claim token, attempt for 'f'). Returns the number of events appended.
APPEND_LUA = FINISH_LUA + LAST_SEQ + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('EPOCH changed') end
local ttl = tonumber(ARGV[3])
local ki, ai, appended = 2, 4, 0
local last = {}
while ai <= #ARGV do
  local kind, data, seq = ARGV[ai], ARGV[ai + 1], tonumber(ARGV[ai + 2])
  local log, chan = KEYS[ki], KEYS[ki + 1]
  local q = last[log]
  if q == nil then q = last_seq(log) end
  if seq > q then
    redis.call('XADD', log, 'MAXLEN', '~', ARGV[2], '*', 'e', data, 'q', seq)
    redis.call('PUBLISH', chan, data)
    if kind ~= 't' or redis.call('TTL', log) < ttl / 2 then redis.call('EXPIRE', log, ttl) end
    appended = appended + 1
    q = seq
  end
  last[log] = q
  if kind == 'f' then
    finish_job(KEYS[ki + 2], KEYS[ki + 3], KEYS[ki + 4], ARGV[ai + 3], ARGV[ai + 4], ARGV[ai + 5], ttl)
    ki, ai = ki + 5, ai + 6
  else
    ki, ai = ki + 2, ai + 3
  end
end
return appended
"""


class Publisher:
    """Args:
    redis: the worker's client.
    cfg: `redis` config (prefix, TTL, maxlen, outage limit, minimum round interval).
    claims: the claim store (epoch, reclaim after data loss).
    table: the job table whose drafts are published.
    on_outage: called with True when Redis becomes unreachable and False when it is
        back (the worker pauses intake meanwhile).
    on_backlog: called before each round with the number of jobs it will carry.
    on_restore: called after Redis lost its data and the logs were restored, with the
        ids of held jobs another worker claimed meanwhile (the worker hands them back and
        re-reads recent cancels into tombstones).
    """

    def __init__(self, redis: aioredis.Redis, cfg: RedisConfig, claims: ClaimStore, table: JobTable, *,
                 on_outage: Callable[[bool], None] = lambda down: None,
                 on_backlog: Callable[[int], None] = lambda num_jobs: None,
                 on_restore: Callable[[list[str]], None] = lambda lost: None) -> None:
        self.redis = redis
        self.cfg = cfg
        self.claims = claims
        self.table = table
        self._append = redis.register_script(APPEND_LUA)
        self._on_outage = on_outage
        self._on_backlog = on_backlog
        self._on_restore = on_restore
        self._wake = asyncio.Event()
        self.outage_since: float | None = None  # time.monotonic() when Redis became unreachable
        self.num_rounds = 0
        self.num_events = 0
        self.num_restores = 0
        self.last_round_s = 0.0
        self.busy = False  # a round is being sent

    @property
    def in_outage(self) -> bool:
        return self.outage_since is not None

    def wake(self) -> None:
        """New drafts in the job table (called after apply_outputs / finish_local)."""
        self._wake.set()

    async def run(self, on_published: Callable[[Round], None]) -> None:
        """Publish rounds until cancelled; `on_published(round)` runs after each one is in
        Redis. Raises RedisUnavailable after `redis.outage_limit_s` without Redis."""
        min_interval = self.cfg.publish_interval_ms / 1000
        while True:
            await self._wake.wait()
            self._wake.clear()
            if min_interval > 0 and self.last_round_s < min_interval:
                await asyncio.sleep(min_interval - self.last_round_s)
            self._on_backlog(self.table.num_drafted)
            rnd = self.table.drain()
            if not rnd:
                continue
            t0 = time.perf_counter()
            self.busy = True
            try:
                await self.send(rnd)
            finally:
                self.busy = False
            self.last_round_s = time.perf_counter() - t0
            on_published(rnd)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every draft is published (bounded). True if it got there."""
        deadline = time.monotonic() + timeout_s
        while (self.table.has_drafts or self.busy) and time.monotonic() < deadline:
            self.wake()
            await asyncio.sleep(0.01)
        return not (self.table.has_drafts or self.busy)

    async def send(self, rnd: Round) -> None:
        """Append and publish one round, riding out connection errors and data loss."""
        delay = 0.05
        while True:
            try:
                await self._send_once(rnd)
                if self.outage_since is not None:
                    log.warning("Redis reachable again; publishing resumed",
                                outage_s=round(time.monotonic() - self.outage_since, 1))
                    self.outage_since = None
                    self._on_outage(False)
                return
            except EpochChanged:
                await self.restore()
            except REDIS_DOWN as e:
                if is_fatal_redis(e):  # refused (credentials rotated, certificate): not an outage
                    raise
                now = time.monotonic()
                if self.outage_since is None:
                    self.outage_since = now
                    log.warning("Redis unreachable; holding events, intake paused", error=repr(e)[:200],
                                limit_s=self.cfg.outage_limit_s, jobs=len(self.table))
                    self._on_outage(True)
                elif now - self.outage_since > self.cfg.outage_limit_s:
                    raise RedisUnavailable(f"Redis unreachable for more than redis.outage_limit_s = "
                                           f"{self.cfg.outage_limit_s} s ({e!r})") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _send_once(self, rnd: Round) -> None:
        ks, args = self._script_args(rnd)
        try:
            appended = await self._append(keys=ks, args=args)
        except ResponseError as e:
            if str(e).startswith("EPOCH"):
                raise EpochChanged(str(e)) from None
            raise
        except NoScriptError:  # flushed between load and call: AsyncScript reloads on the next call
            appended = await self._append(keys=ks, args=args)
        self.num_rounds += 1
        self.num_events += int(appended)

    def _script_args(self, rnd: Round) -> tuple[list[str], list]:
        p = self.cfg.key_prefix
        ks: list[str] = [keys.epoch_key(p)]
        args: list = [self.claims.epoch, self.cfg.log_maxlen, self.cfg.log_ttl_s]
        tokens = {held.job_id: held.claim_token for held in rnd.finished}
        tenants = rnd.tenants or [None] * len(rnd.events)
        for ev, data, tenant in zip(rnd.events, rnd.encoded, tenants):
            jid = ev.job_id
            ks += [keys.log_key(jid, p, tenant), keys.channel(jid, p, tenant)]
            if isinstance(ev, Finished):
                ks += self.claims.finish_keys(jid)
                args += ["f", data, ev.seq, ev.finish_reason.value, tokens.get(jid, ""), ev.attempt]
            else:
                args += ["t" if ev.__struct_config__.tag == "token" else "o", data, ev.seq]
        return ks, args

    async def restore(self) -> None:
        """Redis lost its data: adopt the new epoch, claim the held jobs again (attempts
        never go backwards), re-append every event they and the recently finished jobs
        already published (same seqs; their done marks with the terminal ones)."""
        self.num_restores += 1
        await self.claims.adopt_epoch()
        holding = self.table.holding_claims()
        lost = []
        for held in holding:
            if not await self.claims.reclaim(held.job_id, held.claim_token, held.attempt):
                lost.append(held.job_id)
        p = self.cfg.key_prefix
        ks: list[str] = [keys.epoch_key(p)]
        args: list = [self.claims.epoch, self.cfg.log_maxlen, self.cfg.log_ttl_s]
        n = 0
        for job_id, history, term in self.table.histories():
            tenant = self.table.tenant_of(job_id)
            for seq, data in history:
                ks += [keys.log_key(job_id, p, tenant), keys.channel(job_id, p, tenant)]
                if term is not None and seq == history[-1][0]:
                    reason, token, attempt = term
                    ks += self.claims.finish_keys(job_id)
                    args += ["f", data, seq, reason, token, attempt]
                else:
                    args += ["o", data, seq]
                n += 1
        if n:
            await self._append(keys=ks, args=args)
        log.warning("Redis lost its data (epoch changed): claims and logs restored", held_jobs=len(holding),
                    events_restored=n, lost_claims=lost)
        self._on_restore(lost)

