"""`inflight dlq list` and `inflight dlq replay`: the dead-letter topic as an operator
works with it — what went there and why (the reason headers the worker wrote,
`worker/serve/dlq.py`), and running chosen records again.

Replay re-produces a record's original value to the job topic it came from, under a
**new job id derived from where the dead letter sits** (`<job_id>.replay-<partition>-<offset>`,
the JSON's `job_id` rewritten, the key set to it), with the headers `inflight.replay.of`
(`<dlq topic>:<partition>:<offset>`) and `inflight.replay.source_job_id`. So:
  - the replay never collides with the original job, whose outcome (`finished(rejected)`)
    is already recorded under its id;
  - replaying the same dead letter twice produces the same job id, which the fleet runs
    once (claims dedupe it): nothing is duplicated;
  - records whose reason can never succeed on the same bytes (`invalid_job`, `empty_prompt`,
    `invalid_params`, `invalid_prompt`, `invalid_structured_output`) are refused unless
    `--force`; an undecodable one is then sent with its bytes untouched (it dead-letters
    again with its own error).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import Counter
from typing import Any

import msgspec

from schemas import keys
from schemas.wire import (
    DLQ_HEADER_ERROR,
    DLQ_HEADER_JOB_ID,
    DLQ_HEADER_REASON,
    DLQ_HEADER_SOURCE_OFFSET,
    DLQ_HEADER_SOURCE_PARTITION,
    DLQ_HEADER_SOURCE_TOPIC,
    JOB_ID_MAX_LENGTH,
)

# reasons a replay of the same bytes can never change (the input itself is at fault)
PERMANENT_REASONS = frozenset({"invalid_job", "empty_prompt", "invalid_params", "invalid_prompt",
                               "invalid_structured_output"})
HEADER_REPLAY_OF = "inflight.replay.of"
HEADER_REPLAY_SOURCE_JOB_ID = "inflight.replay.source_job_id"


@dataclasses.dataclass(slots=True, frozen=True)
class DeadLetter:
    """One DLQ record: where it sits, when it was written (Unix ms), its bytes and headers."""

    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]

    def header(self, name: str) -> str | None:
        v = self.headers.get(name)
        return v.decode("utf-8", "replace") if v is not None else None

    @property
    def reason(self) -> str:
        return self.header(DLQ_HEADER_REASON) or "unknown"

    @property
    def job_id(self) -> str | None:
        return self.header(DLQ_HEADER_JOB_ID)

    @property
    def source(self) -> str:
        return (f"{self.header(DLQ_HEADER_SOURCE_TOPIC)}:{self.header(DLQ_HEADER_SOURCE_PARTITION)}:"
                f"{self.header(DLQ_HEADER_SOURCE_OFFSET)}")

    def summary(self) -> dict[str, Any]:
        return {"partition": self.partition, "offset": self.offset,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.timestamp_ms / 1000)),
                "reason": self.reason, "job_id": self.job_id, "source": self.source,
                "error": self.header(DLQ_HEADER_ERROR), "bytes": len(self.value or b"")}


def replay_job_id(job_id: str | None, partition: int, offset: int) -> str:
    """The id a replayed dead letter runs under: deterministic, within the job id pattern
    and length."""
    suffix = f".replay-{partition}-{offset}"
    base = job_id or "dlq"
    if len(base) + len(suffix) > JOB_ID_MAX_LENGTH:
        digest = hashlib.sha256(base.encode()).hexdigest()[:12]
        base = f"{base[: JOB_ID_MAX_LENGTH - len(suffix) - 13]}.{digest}"
    return base + suffix


async def read_dead_letters(kafka, *, reasons: set[str] | None = None, since_ms: int | None = None,
                            job_ids: set[str] | None = None, limit: int | None = None) -> list[DeadLetter]:
    """Every DLQ record written so far (up to the end offsets at the call), filtered by
    reason, job id and write time; oldest first per partition.

    Args:
        kafka: the `KafkaConfig` (bootstrap servers, topic prefix, security).
        since_ms: only records written at or after this Unix time, milliseconds.
        limit: at most this many (the first ones by time).

    Raises:
        aiokafka.errors.KafkaError: Kafka unreachable, or the principal may not read the DLQ.
        ValueError: the DLQ topic does not exist (or this principal cannot see it).
    """
    from worker.cli.scan import scan_topics

    topic = keys.dlq_topic(kafka.topic_prefix)
    try:
        records = await scan_topics(kafka, [topic], since_ms)
    except ValueError:
        raise ValueError(f"no DLQ topic {topic!r} (or not visible to this principal; kafka.topic_prefix "
                         f"{kafka.topic_prefix!r})") from None
    out: list[DeadLetter] = []
    for r in records:
        d = DeadLetter(r.partition, r.offset, r.timestamp, r.key, r.value, {k: v for k, v in (r.headers or ())})
        if (reasons is None or d.reason in reasons) and (job_ids is None or d.job_id in job_ids):
            out.append(d)
    out.sort(key=lambda d: (d.timestamp_ms, d.partition, d.offset))
    return out[:limit] if limit is not None else out


@dataclasses.dataclass(slots=True, frozen=True)
class ReplayResult:
    """What replay did with one dead letter: `sent` under `job_id` to `topic`, or
    `refused` with `why`."""

    dead_letter: DeadLetter
    status: str  # "sent", "refused", "would send" (dry run)
    job_id: str | None = None
    topic: str | None = None
    why: str = ""


def plan_replay(d: DeadLetter, prefix: str, force: bool) -> tuple[ReplayResult, bytes | None, bytes | None]:
    """(the result, the value and key to produce) for one dead letter (nothing sent)."""
    topic = d.header(DLQ_HEADER_SOURCE_TOPIC)
    job_topics = {keys.job_topic(prefix, p) for p in keys.PRIORITIES}
    if topic not in job_topics:
        return ReplayResult(d, "refused", why=f"its source topic {topic!r} is not a job topic of prefix "
                            f"{prefix!r}"), None, None
    if d.reason in PERMANENT_REASONS and not force:
        return ReplayResult(d, "refused", why=f"reason {d.reason!r} can never succeed on the same input "
                            "(--force sends it anyway)"), None, None
    try:
        body = msgspec.json.decode(d.value or b"")
    except msgspec.DecodeError:
        body = None
    if not isinstance(body, dict):  # only with --force: the bytes as they were (they dead-letter again)
        return ReplayResult(d, "sent", job_id=d.job_id, topic=topic), d.value, d.key
    new_id = replay_job_id(body.get("job_id") if isinstance(body.get("job_id"), str) else d.job_id,
                           d.partition, d.offset)
    body["job_id"] = new_id
    return ReplayResult(d, "sent", job_id=new_id, topic=topic), msgspec.json.encode(body), new_id.encode()


async def replay_dead_letters(kafka, letters: list[DeadLetter], *, force: bool = False,
                              dry_run: bool = False) -> list[ReplayResult]:
    """Re-produce `letters` to their job topics (module docstring); waits for every ack.

    Raises:
        aiokafka.errors.KafkaError: the broker did not take a record (those before it were sent).
    """
    from aiokafka import AIOKafkaProducer

    from worker.security.kafka import kafka_security_kwargs, stop_client

    plans = [plan_replay(d, kafka.topic_prefix, force) for d in letters]
    if dry_run:
        return [dataclasses.replace(r, status="would send") if r.status == "sent" else r for r, _, _ in plans]
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all", enable_idempotence=True,
                                max_request_size=kafka.max_partition_fetch_bytes, **kafka_security_kwargs(kafka))
    await producer.start()
    try:
        for result, value, key in plans:
            if result.status != "sent":
                continue
            d = result.dead_letter
            headers = [(HEADER_REPLAY_OF, f"{keys.dlq_topic(kafka.topic_prefix)}:{d.partition}:{d.offset}".encode())]
            if d.job_id:
                headers.append((HEADER_REPLAY_SOURCE_JOB_ID, d.job_id.encode()))
            await producer.send_and_wait(result.topic, value, key=key, headers=headers)
    finally:
        await stop_client(producer, "producer")
    return [r for r, _, _ in plans]


def count_by_reason(letters: list[DeadLetter]) -> dict[str, int]:
    return dict(sorted(Counter(d.reason for d in letters).items(), key=lambda kv: (-kv[1], kv[0])))


def parse_since(value: str | None, now: float | None = None) -> int | None:
    """`--since`: seconds ago (`600`), a duration (`10m`, `2h`, `1d`), or an ISO time
    (`2026-12-01T18:00:00Z`) → Unix milliseconds.

    Raises:
        ValueError: none of those (names the flag).
    """
    if value is None:
        return None
    now = time.time() if now is None else now
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    v = value.strip()
    try:
        if v[-1:] in units and v[:-1].replace(".", "", 1).isdigit():
            return int((now - float(v[:-1]) * units[v[-1]]) * 1000)
        if v.replace(".", "", 1).isdigit():
            return int((now - float(v)) * 1000)
        from datetime import datetime

        return int(datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        raise ValueError(f"--since must be seconds ago (600), a duration (10m, 2h, 1d) or an ISO time, got "
                         f"{value!r}") from None
