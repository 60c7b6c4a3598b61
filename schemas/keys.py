"""Kafka topic names and Redis keys. Every key is built here, never inline.

Redis keys of one job (prefix `inflight` = `redis.key_prefix`):

    inflight:job:<id>                 channel: live events          | jobs without a tenant
    inflight:job:<id>:log             stream: replay log            |
    inflight:t:<tenant>:job:<id>      channel: live events          | jobs with a tenant
    inflight:t:<tenant>:job:<id>:log  stream: replay log            |
    inflight:job:<id>:{claim,attempts,failures,done,cancelled}      worker-internal, every job

Only the two keys a stream consumer reads carry the tenant segment, so one ACL pattern
per tenant (`tenant_pattern`: `inflight:t:<tenant>:job:*`, for keys and channels)
covers exactly that tenant's channels and logs and nothing of the worker's bookkeeping.
The worker-internal keys stay keyed by job id alone: job ids are unique across tenants,
a claim must dedupe a job whatever its record says, and a cancel message (job id only)
must find its tombstone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from schemas.pools import topic_segment

if TYPE_CHECKING:
    from schemas.pools import Pools

PRIORITIES = ("high", "normal", "low")


def job_topic(prefix: str, priority: str, pool: str | None = None) -> str:
    """`inflight.jobs.high` etc.; the topic decides the priority class. A pool other than
    `default` (schemas/pools.py) has its own: `inflight.jobs.long.high`."""
    return f"{prefix}.jobs.{topic_segment(pool)}{priority}"


def cancel_topic(prefix: str) -> str:
    return f"{prefix}.cancel"


def dlq_topic(prefix: str) -> str:
    """Dead letters: records that will never run, original bytes, reason in the headers."""
    return f"{prefix}.dlq"


def results_topic(prefix: str) -> str:
    """Compacted topic of terminal events keyed by job_id: the durable record of every
    outcome, written before the job's offset is committed (Redis is the live channel)."""
    return f"{prefix}.results"


def job_topics(prefix: str, pool: str | None = None) -> list[str]:
    """The job topics of one pool, by priority (high, normal, low)."""
    return [job_topic(prefix, p, pool) for p in PRIORITIES]


def all_topics(prefix: str, pools: Pools | None = None) -> list[str]:
    """Every topic a deployment needs, in creation order: each pool's job topics, then the
    cancel, dead-letter and results topics all pools share."""
    names = [n for pool in (pools.names if pools is not None else [None]) for n in job_topics(prefix, pool)]
    return names + [cancel_topic(prefix), dlq_topic(prefix), results_topic(prefix)]


class JobRef(NamedTuple):
    """A job as its stream keys need it: id and tenant (None: no tenant)."""

    job_id: str
    tenant: str | None = None


def _stream_base(job_id: str, prefix: str, tenant: str | None) -> str:
    return f"{prefix}:t:{tenant}:job:{job_id}" if tenant else f"{prefix}:job:{job_id}"


def channel(job_id: str, prefix: str = "inflight", tenant: str | None = None) -> str:
    """Pub/sub channel with the job's live events (`…:t:<tenant>:job:<id>` for a tenant's
    job). `tenant` must be a valid tenant id (`schemas.wire.check_tenant`)."""
    return _stream_base(job_id, prefix, tenant)


def log_key(job_id: str, prefix: str = "inflight", tenant: str | None = None) -> str:
    """Stream with every event of the job (replay for late or reconnecting clients)."""
    return _stream_base(job_id, prefix, tenant) + ":log"


def tenant_pattern(tenant: str | None, prefix: str = "inflight") -> str:
    """Redis glob matching every channel and log key of one tenant's jobs (None: of the
    jobs without a tenant), for ACL key (`~`) and channel (`&`) patterns and PSUBSCRIBE.
    Tenant ids hold no `:` and no glob character, so no other tenant's keys match."""
    return f"{prefix}:t:{tenant}:job:*" if tenant else f"{prefix}:job:*"


def tombstone_pattern(prefix: str = "inflight") -> str:
    """Redis glob of every cancel tombstone (ACL pattern of clients that may set them)."""
    return f"{prefix}:job:*:cancelled"


def key_space(prefix: str = "inflight") -> str:
    """Redis glob of every key and channel under `prefix` (the worker's ACL pattern)."""
    return f"{prefix}:*"


def claim_key(job_id: str, prefix: str = "inflight") -> str:
    """`SET NX PX` lease held by the worker running the job: value `<worker_id>:<nonce>`."""
    return f"{prefix}:job:{job_id}:claim"


def attempts_key(job_id: str, prefix: str = "inflight") -> str:
    """INCR counter of run attempts."""
    return f"{prefix}:job:{job_id}:attempts"


def done_key(job_id: str, prefix: str = "inflight") -> str:
    """Set (with the log's TTL) when the terminal event is written."""
    return f"{prefix}:job:{job_id}:done"


def cancelled_key(job_id: str, prefix: str = "inflight") -> str:
    """Cancel tombstone (TTL): a job that arrives after its cancel is dropped."""
    return f"{prefix}:job:{job_id}:cancelled"


def suspect_key(job_id: str, prefix: str = "inflight") -> str:
    """When (Redis server time, ms) a claim first found the job at `worker.max_job_failures`:
    it is called poison only `worker.poison_grace_s` after that (a stalled worker may come
    back and clear its failure mark)."""
    return f"{prefix}:job:{job_id}:suspect"


def failures_key(job_id: str, prefix: str = "inflight") -> str:
    """Attempts that started and never ended cleanly (the worker died, or the engine
    failed on the job): incremented on claim, decremented on a clean end. At
    `worker.max_job_failures` the job is not run again (`finished(error)`, code `poison`)."""
    return f"{prefix}:job:{job_id}:failures"


def epoch_key(prefix: str = "inflight") -> str:
    """Marker written once per Redis dataset: if it vanishes (or changes), Redis lost its
    data and the workers restore what clients rely on (see `worker/serve/publish.py`)."""
    return f"{prefix}:epoch"


def restore_window_key(prefix: str = "inflight") -> str:
    """Set (PX one claim lease) with a new epoch by the worker that noticed a data loss:
    while it exists no claim is taken, so jobs whose leases were lost are re-claimed by
    their holders first (see `worker/serve/claims.py`)."""
    return f"{prefix}:epoch:restoring"


def preflight_key(token: str, prefix: str = "inflight") -> str:
    """Probe key `inflight check` writes (with a TTL) and deletes to prove Redis is writable."""
    return f"{prefix}:preflight:{token}"


# ---- the gateway's Batch API (worker/gateway): live state; the durable copy is the batch
# manifest in the gateway's file store, outcomes are in the results topic ----------------
def batch_key(batch_id: str, prefix: str = "inflight") -> str:
    """Hash with one batch's live state: `obj` (the OpenAI batch object as served) and
    `tenant`."""
    return f"{prefix}:gw:batch:{batch_id}"


def response_key(response_id: str, tenant: str | None, prefix: str = "inflight") -> str:
    """String with a stored Responses-API response and its conversation (JSON), for
    `previous_response_id` and `GET /v1/responses/<id>`: per tenant (`…:anon` without
    one), so a key of another tenant never finds it; expires after
    `gateway.responses_ttl_s`."""
    return f"{prefix}:gw:resp:{'t:' + tenant if tenant else 'anon'}:{response_id}"


def batch_owner_key(batch_id: str, prefix: str = "inflight") -> str:
    """`SET NX PX` lease of the gateway process driving the batch (dispatch, collect,
    finalize): value `<gateway id>:<nonce>`."""
    return f"{prefix}:gw:batch:{batch_id}:owner"


def batch_index_key(tenant: str | None, prefix: str = "inflight") -> str:
    """Sorted set of a tenant's batch ids scored by creation time (`GET /v1/batches`):
    `…:gw:batches:t:<tenant>`, or `…:gw:batches:anon` for keys without a tenant (a tenant
    id holds no `:`, so no tenant's key equals another's or `…:active`)."""
    return f"{prefix}:gw:batches:t:{tenant}" if tenant else f"{prefix}:gw:batches:anon"


def active_batches_key(prefix: str = "inflight") -> str:
    """Set of batch ids not yet in a terminal status (gateways adopt those without a live
    owner lease)."""
    return f"{prefix}:gw:batches:active"


def batches_indexed_key(prefix: str = "inflight") -> str:
    """Marker set once the batch keys were rebuilt from the manifests: if it vanishes,
    Redis lost its data and a gateway rebuilds them (worker.gateway.batch.state)."""
    return f"{prefix}:gw:batches:indexed"
