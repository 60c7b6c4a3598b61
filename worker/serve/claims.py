"""Claims in Redis: who runs which job, and the per-job marks around that. This module
owns claim leases, done marks, attempt counters, failure marks, cancel tombstones, the
dataset epoch, and every Lua script that touches them (the event-append script in
`publish.py` ends a job with `FINISH_LUA` from here).

Per job (keys from `schemas.keys`; job id only, whatever the tenant: see there):

    claim      SET NX PX lease, value = this worker's claim token; renewed while it runs
    attempts   INCR on every claim: the `attempt` of the events
    failures   set of attempts that went to the engine and did not end cleanly: added on
               claim (a suspect job, one with failures, only when it enters the engine
               alone), removed on a clean end (terminal event or hand-back); a worker
               that died running it leaves its attempt in it, a worker that stalled
               past its lease and came back removes it (it hands the job back). A job
               with failures runs alone; at `max_job_failures` it is poison once
               `poison_grace_s` has passed since a claim first found it there (suspect).
    suspect    when a claim first found the job at its failure limit (server time)
    done       the finish reason, set with the terminal event (TTL = the log's)
    cancelled  tombstone (TTL): a job that arrives after its cancel is dropped

`take` claims a whole fetched batch in one round trip. Every script first checks the
dataset epoch (`keys.epoch_key`): if Redis lost its data (restarted empty) the epoch is
gone or changed and the call fails with `EpochChanged`, so nothing is written into an
empty Redis before the worker has restored what clients rely on.

A loss can also be partial: replication is asynchronous, so a replica promoted by a
Sentinel failover (or a server restarted from its AOF/RDB files) may lack the last writes
the old one acknowledged. The epoch therefore names the server it was made on (`INFO
server`'s `run_id`: each server process has its own, so a promoted replica or a restarted
server shows another): a worker that finds itself talking to another server than its epoch's
(`epoch_intact`, run by the health check) treats it as a data loss of those writes and
makes a new epoch, so every worker restores as after a total loss (re-appends are
idempotent: a log keeps what it has and gets back what it lost). Until one notices, the
event-append script refuses a round that would leave a gap in a job's log
(`publish.APPEND_LUA`), the other place a lost tail shows.

Data loss must not shorten a claim. The leases vanish with the data while their holders
still run the jobs, so a worker that notices the loss and creates the new epoch also
opens a restore window (`keys.restore_window_key`, one claim lease long): while it lasts
`take` claims nothing (a record's job may still be held by a worker that has not noticed
yet), and every holder that notices re-claims its jobs (`reclaim`) and re-appends their
logs (`Publisher.restore`). Attempts never go backwards: each log entry carries its
attempt (field `a`), and a claim's attempt is above the last one in the job's log even
when the attempt counter was lost.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from schemas import keys
from schemas.replay import LogEntry
from worker.serve.claim_scripts import (
    ADOPT_LUA,
    RECLAIM_LUA,
    RELEASE_LUA,
    RENEW_LUA,
    SUSPECT_LUA,
    TAKE_LUA,
    UNCLAIM_LUA,
)


class EpochChanged(Exception):
    """Redis lost its data (restarted empty) or another worker already noticed that:
    the caller restores its jobs (`Publisher.restore`) and retries. `epoch` is the one
    the refused call carried (a restore that adopted a newer one meanwhile answers it)."""

    def __init__(self, message: str, epoch: str = "") -> None:
        super().__init__(message)
        self.epoch = epoch


@dataclass(slots=True, frozen=True)
class Claimed:
    """This worker now holds the job: `attempt` for its events, `next_seq` continues the
    log, `failures` earlier attempts that never ended cleanly, `cancelled` a tombstone;
    `prior` the log's entries on a later attempt, restored with this attempt's own if
    Redis loses its data."""

    token: str
    attempt: int
    next_seq: int
    failures: int
    cancelled: bool
    prior: tuple[LogEntry, ...] = ()


@dataclass(slots=True, frozen=True)
class Done:
    """The job already has its terminal event (`reason`); `tail` holds the event JSON of
    its log's last entries, newest first (the terminal event among them unless the log
    expired or was lost): the durable record is re-written from it (`Finalizer.settle`)."""

    reason: str
    tail: tuple[bytes, ...] = ()


class Contested:
    """Another live worker holds the job's claim (`restoring`: or may hold it: Redis lost
    its data less than a claim lease ago, see the module docstring)."""

    def __init__(self, restoring: bool = False) -> None:
        self.restoring = restoring


CONTESTED = Contested()
RESTORING = Contested(restoring=True)
TakeResult = Claimed | Done | Contested


class ClaimStore:
    """Claims and per-job marks of one worker. Args:
    redis: the worker's client.
    prefix: `redis.key_prefix`.
    worker_id: prefix of claim tokens (the claim's value names its holder).
    lease_ms: claim lease; renewed every third of it.
    ttl_s: lifetime of done marks, attempt counters and failure marks (the log TTL).
    tombstone_ttl_s: lifetime of cancel tombstones.
    """

    def __init__(self, redis: aioredis.Redis, prefix: str, worker_id: str, *, lease_ms: int, ttl_s: int,
                 tombstone_ttl_s: int) -> None:
        self.redis = redis
        self.prefix = prefix
        self.worker_id = worker_id
        self.lease_ms = lease_ms
        self.ttl_s = ttl_s
        self.tombstone_ttl_s = tombstone_ttl_s
        self.epoch: str = ""
        self._nonce = uuid.uuid4().hex[:8]
        self._num_tokens = 0
        self._scripts = {name: redis.register_script(src) for name, src in (
            ("take", TAKE_LUA), ("renew", RENEW_LUA), ("release", RELEASE_LUA), ("reclaim", RECLAIM_LUA),
            ("unclaim", UNCLAIM_LUA), ("suspect", SUSPECT_LUA),
            ("adopt", ADOPT_LUA))}

    # ---- the dataset epoch ---------------------------------------------------------
    async def adopt_epoch(self) -> bool:
        """Create the epoch marker if Redis has none, then adopt its value. A worker that
        held an epoch before (it noticed a data loss) creates the marker with the restore
        window: no claim is taken for one claim lease (module docstring).

        Returns:
            True if the epoch differs from the one this worker held before (Redis lost its
            data since, or another worker re-created the marker after noticing it).
        """
        p = self.prefix
        window_ms = self.lease_ms if self.epoch else 0
        server = await self.server_id()
        value = await self._scripts["adopt"](keys=[keys.epoch_key(p), keys.restore_window_key(p)],
                                             args=[f"{uuid.uuid4().hex}@{server}", window_ms, server])
        value = value.decode() if isinstance(value, bytes) else str(value)
        changed = bool(self.epoch) and value != self.epoch
        self.epoch = value
        return changed

    async def epoch_intact(self) -> bool:
        """False if the marker is gone or not the adopted one (Redis lost its data), or if
        it was made on another server than the one answering now (a failover or a restart
        from persistence files: the last writes may be lost; module docstring)."""
        value = await self.redis.get(keys.epoch_key(self.prefix))
        if value is None or (value.decode() if isinstance(value, bytes) else value) != self.epoch:
            return False
        server = await self.server_id()
        return not server or self.epoch.endswith(f"@{server}")

    async def server_id(self) -> str:
        """The answering server's `run_id` (new for every server process), '' where
        `INFO` is not allowed (a managed Redis that renames it: no server check then)."""
        try:
            return str((await self.redis.info("server")).get("run_id", ""))
        except ResponseError:
            return ""

    # ---- claims ------------------------------------------------------------------------
    def new_token(self) -> str:
        """A claim token no other claim shares: this worker's id, a random nonce drawn
        once per process, a counter."""
        self._num_tokens += 1
        return f"{self.worker_id}:{self._nonce}:{self._num_tokens}"

    async def take(self, jobs: list[keys.JobRef | str]) -> list[TakeResult]:
        """Claim a batch of jobs in one round trip (see the module docstring). Each job is
        a `JobRef` (id and tenant: the log the next seq is read from) or a bare job id
        (no tenant).

        Raises:
            EpochChanged: Redis lost its data; nothing was written.
            redis.exceptions.ConnectionError / TimeoutError: Redis unreachable.
        """
        if not jobs:
            return []
        p = self.prefix
        ks = [keys.epoch_key(p), keys.restore_window_key(p)]
        tokens = []
        for job in jobs:
            jid, tenant = (job, None) if isinstance(job, str) else job
            ks += [keys.done_key(jid, p), keys.claim_key(jid, p), keys.attempts_key(jid, p),
                   keys.log_key(jid, p, tenant), keys.failures_key(jid, p), keys.cancelled_key(jid, p)]
            tokens.append(self.new_token())
        raw = await self._run("take", ks, [self.epoch, self.lease_ms, self.ttl_s, *tokens])
        out: list[TakeResult] = []
        for token, r in zip(tokens, raw):
            kind = r[0].decode() if isinstance(r[0], bytes) else r[0]
            if kind == "done":
                tail = tuple(_as_bytes(e) for e in (r[2] if len(r) > 2 else []))
                out.append(Done(r[1].decode() if isinstance(r[1], bytes) else str(r[1]), tail))
            elif kind == "contested":
                out.append(CONTESTED)
            elif kind == "restoring":
                out.append(RESTORING)
            else:
                flat = r[5] if len(r) > 5 else []
                prior = tuple(LogEntry(int(flat[i]), int(flat[i + 1]), _as_bytes(flat[i + 2]), _as_bytes(flat[i + 3]).decode())
                              for i in range(0, len(flat), 4))
                out.append(Claimed(token, int(r[1]), int(r[2]), int(r[3]), bool(r[4]), prior))
        return out

    async def mark_running(self, jobs: list[tuple[str, int]]) -> None:
        """Before the engine gets these (job_id, attempt)s: mark each attempt as not yet
        ended cleanly (one round trip). A worker that dies running them leaves the marks."""
        if not jobs:
            return
        pipe = self.redis.pipeline(transaction=False)
        for job_id, attempt in jobs:
            key = keys.failures_key(job_id, self.prefix)
            pipe.sadd(key, attempt)
            pipe.expire(key, self.ttl_s)
        await pipe.execute()

    async def is_done(self, job_id: str) -> bool:
        return bool(await self.redis.exists(keys.done_key(job_id, self.prefix)))

    async def renew(self, claims: dict[str, tuple[str, int]]) -> set[str]:
        """Renew the leases of `claims` (job_id -> (token, attempt)); a lapsed lease is
        re-acquired if nobody claimed the job since (no done mark, its attempt counter
        still ours). Returns the job ids that are another worker's now (lost).

        Raises:
            EpochChanged: Redis lost its data (the caller restores first).
        """
        if not claims:
            return set()
        p = self.prefix
        ids = list(claims)
        ks = [keys.epoch_key(p)]
        args: list = [self.epoch, self.lease_ms]
        for j in ids:
            ks += [keys.claim_key(j, p), keys.done_key(j, p), keys.attempts_key(j, p)]
            args += list(claims[j])
        res = await self._run("renew", ks, args)
        return {j for j, r in zip(ids, res) if int(r) == 0}

    async def release(self, claims: list[tuple[str, str, int]]) -> None:
        """Clean end without a terminal event (hand-back): for each (job_id, token,
        attempt) release the claim if still ours and clear the attempt's failure mark."""
        if not claims:
            return
        p = self.prefix
        ks: list[str] = []
        args: list = [self.ttl_s]
        for jid, token, attempt in claims:
            ks += [keys.done_key(jid, p), keys.claim_key(jid, p), keys.failures_key(jid, p)]
            args += ["", token, attempt]
        await self._run("release", ks, args)

    async def unclaim(self, claims: list[tuple[str, str, int]]) -> None:
        """Forwarded to another pool before it ran here: for each (job_id, token, attempt)
        give the claim back if still ours, clear the attempt's failure mark and undo the
        attempt (claim_scripts.UNCLAIM_LUA)."""
        if not claims:
            return
        p = self.prefix
        ks: list[str] = []
        args: list = []
        for jid, token, attempt in claims:
            ks += [keys.claim_key(jid, p), keys.failures_key(jid, p), keys.attempts_key(jid, p)]
            args += [token, attempt]
        await self._run("unclaim", ks, args)

    async def reclaim(self, held: list[tuple[str, str, int]]) -> list[bool]:
        """After Redis lost its data: hold each (job_id, token, attempt)'s claim again
        (one round trip), attempts never below ours. False for a job another worker
        claimed or ended meanwhile.

        Raises:
            EpochChanged: Redis lost its data again.
        """
        if not held:
            return []
        p = self.prefix
        ks = [keys.epoch_key(p)]
        args: list = [self.epoch, self.lease_ms, self.ttl_s]
        for job_id, token, attempt in held:
            ks += [keys.claim_key(job_id, p), keys.attempts_key(job_id, p), keys.failures_key(job_id, p),
                   keys.done_key(job_id, p)]
            args += [token, attempt]
        return [bool(int(r)) for r in await self._run("reclaim", ks, args)]

    async def tombstone(self, job_id: str) -> None:
        await self.redis.set(keys.cancelled_key(job_id, self.prefix), b"1", ex=self.tombstone_ttl_s)

    async def suspected_for(self, job_ids: list[str]) -> list[float]:
        """Seconds since a claim first found each job at its failure limit (0.0: now, the
        first time); the mark lives `ttl_s`.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: Redis unreachable.
        """
        p = self.prefix
        out = await self._scripts["suspect"](keys=[keys.suspect_key(j, p) for j in job_ids], args=[self.ttl_s])
        return [int(ms) / 1000 for ms in out]

    def finish_keys(self, job_id: str) -> list[str]:
        """Keys `FINISH_LUA`'s `finish_job` takes for a job: done, claim, failures."""
        p = self.prefix
        return [keys.done_key(job_id, p), keys.claim_key(job_id, p), keys.failures_key(job_id, p)]

    async def _run(self, name: str, ks: list[str], args: list):
        epoch = self.epoch
        try:
            return await self._scripts[name](keys=ks, args=args)
        except ResponseError as e:
            if str(e).startswith("EPOCH"):
                raise EpochChanged(str(e), epoch) from None
            raise
        except NoScriptError:  # register_script reloads by itself; a flush mid-call is retried once
            return await self._scripts[name](keys=ks, args=args)


def _as_bytes(v: bytes | str | int) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()
