"""Event publishing to Redis: one pipeline per engine step.

For every event: PUBLISH to `inflight:job:{id}` (live) and XADD to
`inflight:job:{id}:log` (replay; capped, with a TTL). The terminal `finished` event
also sets `…:done` and releases the claim, in the same pipeline, so a redelivered
job sees it as finished. Sequence numbers are per job and never reused: a new
attempt continues after the last `seq` in the log. Writer: the asyncio thread (one
publisher task, so pipelines go out in step order).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from schemas import keys
from schemas.codec import encode
from schemas.wire import ErrorInfo, Finished, Restarted, Started, Timings, Token, TokenLogprob, Usage
from worker.config import RedisConfig

# Delete a claim only if we still hold it (a lease that expired may belong to another worker now).
RELEASE_IF_OWNER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end
"""


# Append one event to the job's log and publish it, unless the log already holds this seq
# or a later one. Publishing is then idempotent: a pipeline re-sent after a connection
# error (redis-py retries) or an event from a worker that lost the job's lease never
# duplicates or reorders entries. KEYS: log stream, channel; ARGV: event, seq, maxlen.
APPEND_EVENT = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if last[1] then
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'q' then
      if tonumber(f[i + 1]) >= tonumber(ARGV[2]) then return 0 end
      break
    end
  end
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'e', ARGV[1], 'q', ARGV[2])
redis.call('PUBLISH', KEYS[2], ARGV[1])
return 1
"""


class JobStream:
    """Sequence numbering for one job attempt."""

    __slots__ = ("job_id", "attempt", "next_seq", "claim_token", "finished", "finish_reason")

    def __init__(self, job_id: str, attempt: int, next_seq: int, claim_token: str) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.next_seq = next_seq
        self.claim_token = claim_token
        self.finished = False
        self.finish_reason: str | None = None

    def _seq(self) -> int:
        s = self.next_seq
        self.next_seq += 1
        return s

    def started(self, worker_id: str, queue_time_s: float | None, metadata: dict[str, Any] | None) -> Started:
        return Started(job_id=self.job_id, seq=self._seq(), attempt=self.attempt, worker_id=worker_id,
                       queue_time_s=queue_time_s, metadata=metadata)

    def restarted(self, reason: str) -> Restarted:
        return Restarted(job_id=self.job_id, seq=self._seq(), attempt=self.attempt, reason=reason)

    def token(self, text: str, token_ids: list[int], logprobs: list[TokenLogprob] | None = None) -> Token:
        return Token(job_id=self.job_id, seq=self._seq(), attempt=self.attempt, text=text, token_ids=token_ids,
                     logprobs=logprobs)

    def finished_event(
        self,
        finish_reason: str,
        *,
        text: str = "",
        usage: Usage | None = None,
        timings: Timings | None = None,
        error: ErrorInfo | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Finished:
        self.finished = True
        self.finish_reason = finish_reason
        return Finished(job_id=self.job_id, seq=self._seq(), attempt=self.attempt, finish_reason=finish_reason,
                        text=text, usage=usage, timings=timings, error=error, metadata=metadata)


class Publisher:
    def __init__(self, redis: aioredis.Redis, cfg: RedisConfig) -> None:
        self.redis = redis
        self.cfg = cfg
        self._append_sha = hashlib.sha1(APPEND_EVENT.encode()).hexdigest()

    async def load_scripts(self) -> None:
        """Load the append script into Redis' script cache (EVALSHA then sends 40 bytes,
        not the script, per event). Publishing reloads it if Redis lost its cache."""
        await self.redis.script_load(APPEND_EVENT)

    async def last_seq(self, job_id: str) -> int:
        """Highest `seq` already in the job's log, or -1."""
        entries = await self.redis.xrevrange(keys.log_key(job_id, self.cfg.key_prefix), count=1)
        if not entries:
            return -1
        return int(msgspec.json.decode(entries[0][1][b"e"])["seq"])

    async def publish(self, events: list[msgspec.Struct], claims: dict[str, str] | None = None) -> None:
        """Write `events` in order in one pipeline (one round trip); idempotent per
        (job, seq), see APPEND_EVENT.

        `claims` maps job_id -> claim token for finished jobs whose claim to release.
        The log's TTL is set by a job's first and last events of an attempt (not by
        every token event: one command fewer per job per step).
        """
        if not events:
            return
        try:
            await self._pipeline(events, claims).execute()
        except NoScriptError:  # Redis restarted or flushed its scripts: load and send again
            await self.load_scripts()
            await self._pipeline(events, claims).execute()  # every command in it is idempotent

    def _pipeline(self, events: list[msgspec.Struct], claims: dict[str, str] | None):
        p = self.cfg.key_prefix
        ttl = self.cfg.log_ttl_s
        pipe = self.redis.pipeline(transaction=False)
        touched: set[str] = set()
        for ev in events:
            data = encode(ev)
            jid = ev.job_id
            pipe.evalsha(self._append_sha, 2, keys.log_key(jid, p), keys.channel(jid, p), data, ev.seq,
                         self.cfg.log_maxlen)
            if not isinstance(ev, Token):
                touched.add(jid)
            if isinstance(ev, Finished):
                pipe.set(keys.done_key(jid, p), ev.finish_reason, ex=ttl)
        for jid in touched:
            pipe.expire(keys.log_key(jid, p), ttl)
        self._release(pipe, claims or {})
        return pipe

    async def release_claims(self, claims: dict[str, str]) -> None:
        """Release claims (job_id -> token) still held by this worker, in one round trip."""
        if claims:
            pipe = self.redis.pipeline(transaction=False)
            self._release(pipe, claims)
            await pipe.execute()

    def _release(self, pipe, claims: dict[str, str]) -> None:
        for jid, token in claims.items():
            pipe.eval(RELEASE_IF_OWNER, 1, keys.claim_key(jid, self.cfg.key_prefix), token)
