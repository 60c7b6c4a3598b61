"""Event publishing to Redis: one pipeline per engine step.

For every event: PUBLISH to `inflight:job:{id}` (live) and XADD to
`inflight:job:{id}:log` (replay; capped, with a TTL). The terminal `finished` event
also sets `…:done` and releases the claim, in the same pipeline, so a redelivered
job sees it as finished. Sequence numbers are per job and never reused: a new
attempt continues after the last `seq` in the log. Writer: the asyncio thread (one
publisher task, so pipelines go out in step order).
"""

from __future__ import annotations

from typing import Any

import msgspec
import redis.asyncio as aioredis

from schemas import keys
from schemas.codec import encode
from schemas.wire import ErrorInfo, Finished, Restarted, Started, Timings, Token, TokenLogprob, Usage
from worker.config import RedisConfig

# Delete a claim only if we still hold it (a lease that expired may belong to another worker now).
RELEASE_IF_OWNER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end
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

    async def last_seq(self, job_id: str) -> int:
        """Highest `seq` already in the job's log, or -1."""
        entries = await self.redis.xrevrange(keys.log_key(job_id, self.cfg.key_prefix), count=1)
        if not entries:
            return -1
        return int(msgspec.json.decode(entries[0][1][b"e"])["seq"])

    async def publish(self, events: list[msgspec.Struct], claims: dict[str, str] | None = None) -> None:
        """Write `events` in order in one pipeline (one round trip).

        `claims` maps job_id -> claim token for finished jobs whose claim to release.
        The log's TTL is set by a job's first and last events of an attempt (not by
        every token event: one command fewer per job per step).
        """
        if not events:
            return
        p = self.cfg.key_prefix
        ttl = self.cfg.log_ttl_s
        pipe = self.redis.pipeline(transaction=False)
        touched: set[str] = set()
        for ev in events:
            data = encode(ev)
            jid = ev.job_id
            pipe.xadd(keys.log_key(jid, p), {b"e": data}, maxlen=self.cfg.log_maxlen, approximate=True)
            pipe.publish(keys.channel(jid, p), data)
            if not isinstance(ev, Token):
                touched.add(jid)
            if isinstance(ev, Finished):
                pipe.set(keys.done_key(jid, p), ev.finish_reason, ex=ttl)
        for jid in touched:
            pipe.expire(keys.log_key(jid, p), ttl)
        self._release(pipe, claims or {})
        await pipe.execute()

    async def release_claims(self, claims: dict[str, str]) -> None:
        """Release claims (job_id -> token) still held by this worker, in one round trip."""
        if claims:
            pipe = self.redis.pipeline(transaction=False)
            self._release(pipe, claims)
            await pipe.execute()

    def _release(self, pipe, claims: dict[str, str]) -> None:
        for jid, token in claims.items():
            pipe.eval(RELEASE_IF_OWNER, 1, keys.claim_key(jid, self.cfg.key_prefix), token)
