"""Event publishing to Redis: one script call per round, whatever the number of events.

The publisher is the one task that writes events. Each round it takes every event the
job table has drafted since the last round (`JobTable.drain`: per job the opening events,
one merged `token` event, the terminal one) and sends them in one EVALSHA of
`APPEND_LUA`, which for every event:

    XADD   inflight:job:{id}:log  (replay; capped, TTL refreshed when half gone)
    PUBLISH inflight:job:{id}     (live)

(`inflight:t:{tenant}:job:{id}…` for a job with a tenant: `Round.tenants`, `schemas.keys`),

unless the log already holds that `seq` or a later one (idempotent: a round re-sent after
a connection error never duplicates or reorders entries), and only while the job's claim
is this worker's: an event of a job another worker holds now (we stalled past the lease,
or Redis lost the claim) is refused, the job is handed back (`on_lost`) and its terminal
event, if it had one, is neither published nor recorded. A terminal event also sets the
done mark, releases the claim and clears the attempt's failure mark
(`claims.FINISH_LUA`). Each log entry holds the event (`e`), its seq (`q`) and attempt
(`a`). With `redis.compact_logs` the terminal event's round first rewrites the job's log
in its compacted form (each run of token events one entry, `schemas.replay`), in the same
script call, so a reader sees either the whole log or the compacted one. When the publisher falls behind the engine (a slow Redis, a burst), rounds simply
carry more tokens per event: fewer, larger deltas, the same text (token coalescing).

Outages: a round that cannot reach Redis is retried with backoff while the engine keeps
running its jobs (their tokens keep merging into the drafts) and intake pauses; after
`redis.outage_limit_s` without Redis the publisher gives up (`RedisUnavailable`) and the
worker exits promptly so its partitions move. Data loss: if Redis restarted empty (the
epoch marker is gone, see `claims.py`), `restore` re-claims the held jobs and re-appends
every event each of them (and each recently finished job) already published, with the
same seqs, before anything new is written (one lock orders restores and rounds, whoever
noticed the loss: a round, a claim, the health check), so a log read from its first
entry still reassembles to the final text. A partial loss (a Sentinel failover to a
replica that missed the last writes) is the same restore: the health check sees another
server than the epoch's and makes a new epoch, and a round that would leave a gap in a
log is refused until the restore has filled it (`claims.py`).
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
from worker.obs.stopping import honour_cancellation
from worker.security.access import is_fatal_redis
from worker.security.redis import REDIS_DOWN, RedisUnavailable
from worker.serve.claim_scripts import FINISH_LUA, LAST_EVENTS, LAST_SEQ
from worker.serve.claims import ClaimStore, EpochChanged
from worker.serve.jobs import JobTable
from worker.serve.local_job import Round

log = structlog.get_logger(__name__)

# KEYS: epoch, then per event: log, channel, done, claim, failures, attempts.
# ARGV: epoch, maxlen, ttl, lease_ms, strict ('1' a live round, '0' a restore), then per
# event: kind ('t' token, 'o' other, 'f' terminal, 'p' an entry of the job's compacted
# log), data, seq, attempt, claim token, and the finish reason for 'f', the entry's
# splits for 'p' and 'o' ('' for none).
# 'p' entries precede their job's 'f' in the same call: when the 'f' is appended, the log
# is first rewritten as those entries (the first keeps the log's first stream id, the
# others get the rewrite's time), then the 'f' follows. An 'o' with splits (a compacted run,
# restored) is appended without being published: live readers never see a run whole.
# Per job (its first event in the call decides): the claim is ours (or lapsed with
# nobody claiming the job since: no done mark, the attempt counter still ours; taken
# back) -> its events are appended unless the log already holds
# their seq (a re-sent round); the claim is another worker's, or the job ended without
# our terminal event among the log's last entries -> refused (nothing of it appended).
# An appended terminal event sets the done mark and releases the claim. A live round
# whose event would leave a gap in its job's log (a seq past the last one + 1, or past 0
# in a log that is gone) finds writes lost (a failover to a replica that missed them): the
# call fails with 'EPOCH gap' and the worker restores before sending it again. Returns
# {appended, refused event indices (1-based, the first of each refused job)}.
APPEND_LUA = FINISH_LUA + LAST_SEQ + LAST_EVENTS + """
local function rewrite(log, entries)
  local first = redis.call('XRANGE', log, '-', '+', 'COUNT', 1)[1]
  redis.call('DEL', log)
  for i, p in ipairs(entries) do
    local id = '*'
    if i == 1 and first then id = first[1] end
    if p[4] ~= '' then
      redis.call('XADD', log, id, 'e', p[1], 'q', p[2], 'a', p[3], 's', p[4])
    else
      redis.call('XADD', log, id, 'e', p[1], 'q', p[2], 'a', p[3])
    end
  end
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('EPOCH changed') end
local ttl = tonumber(ARGV[3])
local strict = ARGV[5] == '1'
local ki, ai, appended, ev = 2, 6, 0, 0
local last, owner, refused, pending = {}, {}, {}, {}
while ai <= #ARGV do
  ev = ev + 1
  local kind, data, seq, attempt, token = ARGV[ai], ARGV[ai + 1], tonumber(ARGV[ai + 2]), ARGV[ai + 3], ARGV[ai + 4]
  local log, chan, done, claim = KEYS[ki], KEYS[ki + 1], KEYS[ki + 2], KEYS[ki + 3]
  if owner[log] == nil then
    local cur = redis.call('GET', claim)
    if cur == token then
      owner[log] = 'ours'
    elseif cur then
      owner[log] = 'theirs'
    elseif redis.call('EXISTS', done) == 1 then
      owner[log] = 'ended'
    elseif tonumber(redis.call('GET', KEYS[ki + 5]) or '0') == tonumber(attempt) then
      redis.call('SET', claim, token, 'PX', ARGV[4])
      owner[log] = 'ours'
    else
      owner[log] = 'theirs'  -- claimed by another since, and handed back
    end
    if owner[log] == 'theirs' then refused[#refused + 1] = ev end
  end
  if owner[log] == 'ended' and kind == 'f' then  -- ended by this very event (a re-sent round), or by another?
    local ours = false
    for _, e in ipairs(last_events(log)) do if e == data then ours = true end end
    owner[log] = ours and 'ended-by-us' or 'theirs'
    if not ours then refused[#refused + 1] = ev end
  end
  if kind == 'p' then
    if owner[log] == 'ours' then
      pending[log] = pending[log] or {}
      table.insert(pending[log], {data, ARGV[ai + 2], attempt, ARGV[ai + 5]})
    end
  else
    local q = last[log]
    if q == nil then q = last_entry(log) end
    if strict and seq > q + 1 and owner[log] == 'ours' then
      return redis.error_reply('EPOCH gap: ' .. log .. ' ends at seq ' .. q .. ', next is ' .. seq)
    end
    if seq > q and owner[log] == 'ours' then
      if kind == 'f' and pending[log] then rewrite(log, pending[log]) end
      if kind == 'o' and ARGV[ai + 5] ~= '' then
        redis.call('XADD', log, 'MAXLEN', '~', ARGV[2], '*', 'e', data, 'q', seq, 'a', attempt, 's', ARGV[ai + 5])
      else
        redis.call('XADD', log, 'MAXLEN', '~', ARGV[2], '*', 'e', data, 'q', seq, 'a', attempt)
        redis.call('PUBLISH', chan, data)
      end
      if kind ~= 't' or redis.call('TTL', log) < ttl / 2 then redis.call('EXPIRE', log, ttl) end
      appended = appended + 1
      q = seq
      if kind == 'f' then finish_job(done, claim, KEYS[ki + 4], ARGV[ai + 5], token, attempt, ttl) end
    end
    last[log] = q
  end
  ki, ai = ki + 6, ai + 6
end
return {appended, refused}
"""


class Publisher:
    """Writes each round of drafted events to Redis in one script call; holds them through an outage and restores after a data loss.

    Args:
        redis: the worker's client.
        cfg: `redis` config (prefix, TTL, maxlen, outage limit, minimum round interval).
        claims: the claim store (epoch, reclaim after data loss).
        table: the job table whose drafts are published.
        on_outage: called with True when Redis becomes unreachable and False when it is
            back (the worker pauses intake meanwhile).
        on_backlog: called before each round with the number of jobs it will carry.
        on_lost: called with the ids of held jobs another worker holds now: their events
            were refused (a round) or their claim went to another worker while Redis had lost
            its data (a restore). The worker hands them back; nothing more of theirs is
            published, and a refused terminal event is not recorded.
        on_restore: called after Redis lost its data and the logs were restored (metrics; the
            cancels whose tombstones were lost still answer from the cancel index).
    """

    def __init__(self, redis: aioredis.Redis, cfg: RedisConfig, claims: ClaimStore, table: JobTable, *,
                 on_outage: Callable[[bool], None] = lambda down: None,
                 on_backlog: Callable[[int], None] = lambda num_jobs: None,
                 on_lost: Callable[[list[str]], None] = lambda job_ids: None,
                 on_restore: Callable[[], None] = lambda: None) -> None:
        self.redis = redis
        self.cfg = cfg
        self.claims = claims
        self.table = table
        self._append = redis.register_script(APPEND_LUA)
        self._on_outage = on_outage
        self._on_backlog = on_backlog
        self._on_lost = on_lost
        self._on_restore = on_restore
        self._wake = asyncio.Event()
        # Every write of events and the restore take this lock: nothing is appended in a
        # new epoch before the restore has re-appended what was published in the old one.
        self._lock = asyncio.Lock()
        self._restore_pending = False  # a data loss was seen and the restore has not completed
        self.outage_since: float | None = None  # time.monotonic() when Redis became unreachable
        self.num_rounds = 0
        self.num_events = 0
        self.num_restores = 0
        self.num_refused = 0  # events refused: their job's claim is another worker's
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
        Redis (its `finished` without the jobs whose terminal event was refused).
        Raises RedisUnavailable after `redis.outage_limit_s` without Redis."""
        min_interval = self.cfg.publish_interval_ms / 1000
        while True:
            honour_cancellation()
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
                refused = await self.send(rnd)
            finally:
                self.busy = False
            self.last_round_s = time.perf_counter() - t0
            if refused:
                rnd.finished = [held for held in rnd.finished if held.job_id not in refused]
            on_published(rnd)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every draft is published (bounded). True if it got there."""
        deadline = time.monotonic() + timeout_s
        while (self.table.has_drafts or self.busy) and time.monotonic() < deadline:
            self.wake()
            await asyncio.sleep(0.01)
        return not (self.table.has_drafts or self.busy)

    async def send(self, rnd: Round) -> set[str]:
        """Append and publish one round, riding out connection errors and data loss.
        Returns the ids of jobs whose events were refused (another worker holds them)."""
        delay = 0.05
        while True:
            honour_cancellation()
            try:
                refused = await self._send_once(rnd)
                if self.outage_since is not None:
                    log.warning("Redis reachable again; publishing resumed",
                                outage_s=round(time.monotonic() - self.outage_since, 1))
                    self.outage_since = None
                    self._on_outage(False)
                if refused:
                    self.num_refused += len(refused)
                    log.warning("events refused: another worker holds these jobs now", job_ids=sorted(refused)[:20],
                                num_jobs=len(refused))
                    self._on_lost(sorted(refused))
                return refused
            except EpochChanged:
                self._restore_pending = True  # the next try restores first (under the lock)
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

    async def _send_once(self, rnd: Round) -> set[str]:
        async with self._lock:
            if self._restore_pending:
                await self._restore()
            ks, args, job_of = self._script_args(rnd)
            raw = await self._call(ks, args)
        appended, refused = int(raw[0]), raw[1]
        self.num_rounds += 1
        self.num_events += appended
        return {job_of[int(i) - 1] for i in refused}

    async def _call(self, ks: list[str], args: list):
        epoch = args[0]
        try:
            return await self._append(keys=ks, args=args)
        except ResponseError as e:
            if str(e).startswith("EPOCH"):
                raise EpochChanged(str(e), epoch) from None
            raise
        except NoScriptError:  # flushed between load and call: AsyncScript reloads on the next call
            return await self._append(keys=ks, args=args)

    def _script_head(self, strict: bool) -> tuple[list[str], list]:
        """The KEYS and ARGV every `APPEND_LUA` call starts with: the epoch key; the epoch,
        log bounds, lease, and whether a gap in a log refuses the call (a live round) or
        not (a restore, which fills gaps)."""
        return ([keys.epoch_key(self.cfg.key_prefix)],
                [self.claims.epoch, self.cfg.log_maxlen, self.cfg.log_ttl_s, self.claims.lease_ms,
                 "1" if strict else "0"])

    def _job_keys(self, job_id: str, tenant: str | None) -> list[str]:
        """The KEYS one event of `job_id` adds to an `APPEND_LUA` call, in the script's
        order: its log, its channel, its claim's finish keys, its attempts."""
        p = self.cfg.key_prefix
        return [keys.log_key(job_id, p, tenant), keys.channel(job_id, p, tenant), *self.claims.finish_keys(job_id),
                keys.attempts_key(job_id, p)]

    def _script_args(self, rnd: Round) -> tuple[list[str], list, list[str]]:
        """KEYS and ARGV of `APPEND_LUA` for a round, and the job of each event sent (a
        job's compacted log goes just before its terminal event)."""
        ks, args = self._script_head(strict=True)
        job_of: list[str] = []
        tenants = rnd.tenants or [None] * len(rnd.events)
        tokens = rnd.tokens or [""] * len(rnd.events)
        for ev, data, tenant, token in zip(rnd.events, rnd.encoded, tenants, tokens):
            jid = ev.job_id
            job_keys = self._job_keys(jid, tenant)
            if isinstance(ev, Finished):
                for entry in rnd.compacted.get(jid, ()):
                    ks += job_keys
                    args += ["p", entry.data, entry.seq, entry.attempt, token, entry.splits]
                    job_of.append(jid)
                args += ["f", data, ev.seq, ev.attempt, token, ev.finish_reason.value]
            else:
                args += ["t" if ev.__struct_config__.tag == "token" else "o", data, ev.seq, ev.attempt, token, ""]
            ks += job_keys
            job_of.append(jid)
        return ks, args, job_of

    async def restore(self, stale_epoch: str | None = None) -> None:
        """Redis lost its data (a write was refused with `stale_epoch`, or the health check
        found the marker gone): restore now, unless a restore since adopted a newer epoch.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis unreachable (the restore
                stays pending: the next round does it before anything else).
        """
        async with self._lock:
            if stale_epoch is not None and stale_epoch != self.claims.epoch and not self._restore_pending:
                return  # already restored
            self._restore_pending = True
            await self._restore()

    async def _restore(self) -> None:
        """Under the lock: adopt the new epoch (the first worker to notice opens the
        restore window), claim the held jobs again (attempts never go backwards), then
        re-append every event they and the recently finished jobs already published (same
        seqs; done marks with the terminal ones). Held jobs another worker claimed
        meanwhile are reported lost; nothing of theirs is re-appended. Repeated until it
        completes in one epoch."""
        while self._restore_pending:
            try:
                await self._restore_once()
                self._restore_pending = False
            except EpochChanged:
                continue  # lost its data again while restoring: start over

    async def _restore_once(self) -> None:
        self.num_restores += 1
        await self.claims.adopt_epoch()
        holding = self.table.holding_claims()
        histories = list(self.table.histories())
        held_ids = {held.job_id for held in holding}
        recent = [(job_id, token, attempt) for job_id, attempt, token, *_ in histories if job_id not in held_ids]
        ours = await self.claims.reclaim([(held.job_id, held.claim_token, held.attempt) for held in holding] + recent)
        lost = [held.job_id for held, ok in zip(holding, ours) if not ok]
        # a recently finished job another worker claimed or ended since is theirs now
        skip = set(lost) | {job_id for (job_id, _, _), ok in zip(recent, ours[len(holding):]) if not ok}
        ks, args = self._script_head(strict=False)
        job_of: list[str] = []  # the job of each event sent
        for job_id, attempt, token, history, reason, prior in histories:
            if job_id in skip:
                continue
            tenant = self.table.tenant_of(job_id)
            job_keys = self._job_keys(job_id, tenant)
            # An ended job's history is its compacted log: sent as 'p' entries before its
            # terminal event, the log is rewritten whole where the terminal is missing (as
            # the live terminal round does). Appended run by run instead, a run would land
            # on a log that kept part of it one event per entry (a failover, a restart from
            # its files: Redis lost only the tail), and repeat those events.
            rewrite = reason is not None and any(e.splits for e in (*prior, *history))
            kind = "p" if rewrite else "o"
            for entry in prior:  # the earlier attempts' entries, as they were
                ks += job_keys
                args += [kind, entry.data, entry.seq, entry.attempt, token, entry.splits]
                job_of.append(job_id)
            last = len(history) - 1
            for i, entry in enumerate(history):
                ks += job_keys
                if reason is not None and i == last:
                    args += ["f", entry.data, entry.seq, attempt, token, reason]
                else:
                    args += [kind, entry.data, entry.seq, attempt, token, entry.splits]
                job_of.append(job_id)
        refused: set[str] = set()
        if job_of:
            refused = {job_of[int(i) - 1] for i in (await self._call(ks, args))[1]}
        lost += sorted(refused & held_ids)  # a finished job's log another worker rewrote stays theirs
        log.warning("Redis lost its data (epoch changed): claims and logs restored", held_jobs=len(holding),
                    events_restored=len(job_of), lost_claims=lost, refused_jobs=len(refused))
        if lost:
            self._on_lost(lost)
        self._on_restore()
