"""Batch state: OpenAI's batch object and its lifecycle, kept in two places.

  - the **manifest** in the file store (`worker.gateway.files`): the durable state. It is
    written at every status change and after every dispatched chunk (the dispatch
    cursor), so a gateway that restarts, or another one, resumes the batch from it;
  - **Redis** (keys from `schemas.keys`): the live copy every gateway serves `GET` from
    (counts move between checkpoints), the per-tenant index for listing, the set of
    active batches and the driver's lease. If Redis loses its data, the gateways rebuild
    it from the manifests (`reindex`), and reads fall back to the manifests meanwhile.

Outcomes of lines are in neither: they are read from the durable results topic
(`worker.gateway.batch.driver`).

Lifecycle (OpenAI's): validating → in_progress → finalizing → completed; validating →
failed (no valid line); in_progress → cancelling → cancelled; in_progress → expired
(`completion_window` passed). Only the driver holding the lease changes status.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import msgspec
import structlog
from redis.exceptions import RedisError

from schemas import keys
from worker.gateway.batch.lines import LineError
from worker.gateway.files import FileStore

log = structlog.get_logger(__name__)

TERMINAL = ("completed", "failed", "expired", "cancelled")


class RequestCounts(msgspec.Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchObject(msgspec.Struct, kw_only=True):
    """OpenAI's batch object, as served."""

    id: str
    object: str = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: dict[str, Any] | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL


class Manifest(msgspec.Struct, kw_only=True):
    """The durable state of one batch.

    Attributes:
        batch: the batch object.
        tenant: the tenant of the key that created it (its lines run as that tenant).
        priority: the topic its lines go to.
        results_start: results-topic offset per partition before its first line was
            produced: its outcomes are at or after these.
        dispatched: how many valid lines (in input order) have been produced.
        invalid: the input lines that failed validation.
        final_status: the terminal status being written while `finalizing`.
        topic_prefix: the deployment's `kafka.topic_prefix`: gateways of another
            deployment sharing the directory leave the batch alone.
    """

    batch: BatchObject
    tenant: str | None = None
    priority: str = "low"
    results_start: dict[int, int] | None = None
    dispatched: int = 0
    invalid: list[LineError] = []
    final_status: str | None = None
    topic_prefix: str = ""


_manifest = msgspec.json.Decoder(Manifest)
_object = msgspec.json.Decoder(BatchObject)
_encode = msgspec.json.Encoder().encode

# Renew our lease (or take it back if Redis lost it); 0: someone else holds it.
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""


class BatchStore:
    """Batch state: objects and counts in Redis, manifests on the file store, leases, the index rebuilt after a data loss.

    Args:
        redis: the gateway's Redis client.
        files: the file store holding the manifests.
        key_prefix: `redis.key_prefix`.
        owner_id: this gateway process (lease values).
        lease_ms: `gateway.batch_lease_ms`.
    """

    def __init__(self, redis, files: FileStore, key_prefix: str, owner_id: str, lease_ms: int,
                 topic_prefix: str) -> None:
        self.redis = redis
        self.files = files
        self.prefix = key_prefix
        self.topic_prefix = topic_prefix
        self.owner_id = owner_id
        self.lease_ms = lease_ms
        self._renew = redis.register_script(_RENEW)

    # ---- writes ----------------------------------------------------------------------------
    async def save(self, m: Manifest, *, durable: bool = True) -> None:
        """Write the manifest (when `durable`) and then the live copy in Redis. A Redis
        failure is logged, not raised: the batch goes on and Redis is rebuilt later."""
        if durable:
            await asyncio.to_thread(self.files.write_manifest, m.batch.id, _encode(m))
        await self.publish(m)

    async def publish(self, m: Manifest) -> None:
        b = m.batch
        try:
            async with self.redis.pipeline(transaction=False) as p:
                p.hset(keys.batch_key(b.id, self.prefix), mapping={"obj": _encode(b), "tenant": m.tenant or ""})
                p.zadd(keys.batch_index_key(m.tenant, self.prefix), {b.id: b.created_at})
                if b.is_terminal:
                    p.srem(keys.active_batches_key(self.prefix), b.id)
                else:
                    p.sadd(keys.active_batches_key(self.prefix), b.id)
                await p.execute()
        except (RedisError, OSError) as e:
            log.warning("could not update the batch in Redis (the manifest is authoritative)", batch_id=b.id,
                        error=repr(e)[:200])

    # ---- reads -----------------------------------------------------------------------------
    async def load(self, batch_id: str) -> Manifest | None:
        """The manifest (durable state), or None (also for another deployment's batch)."""
        return await asyncio.to_thread(self._load, batch_id)

    def _load(self, batch_id: str) -> Manifest | None:
        data = self.files.read_manifest(batch_id)
        m = _manifest.decode(data) if data is not None else None
        return m if m is not None and m.topic_prefix == self.topic_prefix else None

    async def get(self, batch_id: str, tenant: str | None) -> BatchObject | None:
        """The batch as `tenant` may see it (None: no such batch of that tenant): the live
        copy in Redis, else the manifest."""
        try:
            got = await self.redis.hmget(keys.batch_key(batch_id, self.prefix), ["obj", "tenant"])
        except (RedisError, OSError):
            got = [None, None]
        if got[0] is not None:
            return _object.decode(got[0]) if (got[1] or b"").decode() == (tenant or "") else None
        m = await self.load(batch_id)
        return m.batch if m is not None and m.tenant == tenant else None

    async def list(self, tenant: str | None, after: str | None, limit: int) -> tuple[list[BatchObject], bool]:
        """A tenant's batches, newest first, after the batch id `after`; (page, has_more)."""
        try:
            ids = [i.decode() for i in await self.redis.zrevrange(keys.batch_index_key(tenant, self.prefix), 0, -1)]
        except (RedisError, OSError):
            ids = []
        if not ids:  # Redis lost its index (or has none yet): the manifests know
            ms = [m for m in await asyncio.to_thread(self._all_manifests) if m.tenant == tenant]
            ids = [m.batch.id for m in sorted(ms, key=lambda m: (m.batch.created_at, m.batch.id), reverse=True)]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        page = []
        for batch_id in ids[:limit]:
            obj = await self.get(batch_id, tenant)
            if obj is not None:
                page.append(obj)
        return page, len(ids) > limit

    def _all_manifests(self) -> list[Manifest]:
        return [m for m in map(self._load, self.files.manifest_ids()) if m is not None]

    async def active_ids(self) -> set[str]:
        """Batches not in a terminal status (from Redis; empty if it is unreachable)."""
        try:
            return {i.decode() for i in await self.redis.smembers(keys.active_batches_key(self.prefix))}
        except (RedisError, OSError):
            return set()

    async def reindex(self) -> int:
        """If Redis lost the batch keys (its marker is gone), rebuild them from the
        manifests. Returns how many batches were written (0: nothing to do)."""
        marker = keys.batches_indexed_key(self.prefix)
        if await self.redis.exists(marker):
            return 0
        manifests = await asyncio.to_thread(self._all_manifests)
        for m in manifests:
            await self.publish(m)
        await self.redis.set(marker, b"1")
        if manifests:
            log.info("batch state rebuilt in Redis from the manifests", batches=len(manifests))
        return len(manifests)

    # ---- the driver's lease ------------------------------------------------------------------
    async def take_lease(self, batch_id: str) -> str | None:
        """A lease token if nobody drives the batch, else None (also when Redis is down)."""
        token = f"{self.owner_id}:{secrets.token_hex(4)}"
        try:
            ok = await self.redis.set(keys.batch_owner_key(batch_id, self.prefix), token, nx=True, px=self.lease_ms)
        except (RedisError, OSError):
            return None
        return token if ok else None

    async def renew_lease(self, batch_id: str, token: str) -> bool:
        """False only when another gateway holds the lease now (Redis errors raise)."""
        return bool(await self._renew(keys=[keys.batch_owner_key(batch_id, self.prefix)],
                                      args=[token, self.lease_ms]))

    async def release_lease(self, batch_id: str, token: str) -> None:
        try:
            key = keys.batch_owner_key(batch_id, self.prefix)
            if (await self.redis.get(key) or b"").decode() == token:
                await self.redis.delete(key)
        except (RedisError, OSError):
            pass  # it lapses by itself
