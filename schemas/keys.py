"""Kafka topic names and Redis keys. Every key is built here, never inline."""

from __future__ import annotations

PRIORITIES = ("high", "normal", "low")


def job_topic(prefix: str, priority: str) -> str:
    """`inflight.jobs.high` etc.; the topic decides the priority class."""
    return f"{prefix}.jobs.{priority}"


def cancel_topic(prefix: str) -> str:
    return f"{prefix}.cancel"


def dlq_topic(prefix: str) -> str:
    """Dead letters: records that will never run, original bytes, reason in the headers."""
    return f"{prefix}.dlq"


def results_topic(prefix: str) -> str:
    """Compacted topic of terminal events keyed by job_id: the durable record of every
    outcome, written before the job's offset is committed (Redis is the live channel)."""
    return f"{prefix}.results"


def all_topics(prefix: str) -> list[str]:
    """Every topic a deployment needs, in creation order."""
    return [job_topic(prefix, p) for p in PRIORITIES] + [cancel_topic(prefix), dlq_topic(prefix),
                                                         results_topic(prefix)]


def channel(job_id: str, prefix: str = "inflight") -> str:
    """Pub/sub channel with the job's live events."""
    return f"{prefix}:job:{job_id}"


def log_key(job_id: str, prefix: str = "inflight") -> str:
    """Stream with every event of the job (replay for late or reconnecting clients)."""
    return f"{prefix}:job:{job_id}:log"


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


def failures_key(job_id: str, prefix: str = "inflight") -> str:
    """Attempts that started and never ended cleanly (the worker died, or the engine
    failed on the job): incremented on claim, decremented on a clean end. At
    `worker.max_job_failures` the job is not run again (`finished(error)`, code `poison`)."""
    return f"{prefix}:job:{job_id}:failures"


def epoch_key(prefix: str = "inflight") -> str:
    """Marker written once per Redis dataset: if it vanishes (or changes), Redis lost its
    data and the workers restore what clients rely on (see `worker/publish.py`)."""
    return f"{prefix}:epoch"


def preflight_key(token: str, prefix: str = "inflight") -> str:
    """Probe key `inflight check` writes (with a TTL) and deletes to prove Redis is writable."""
    return f"{prefix}:preflight:{token}"
