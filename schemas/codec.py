"""Encoders/decoders, built once. `decode_job` and friends raise `msgspec.DecodeError`
(not JSON) or `msgspec.ValidationError` (wrong type, missing field, bad value, unknown
`v`), with the field path in the message."""


from __future__ import annotations

import unicodedata

import msgspec

from schemas.wire import JOB_ID_MAX_LENGTH, Cancel, Event, Job, check_tenant

_encoder = msgspec.json.Encoder()
_job = msgspec.json.Decoder(Job)
_cancel = msgspec.json.Decoder(Cancel)
_event = msgspec.json.Decoder(Event)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_job(data: bytes) -> Job:
    return _job.decode(data)


def decode_cancel(data: bytes) -> Cancel:
    return _cancel.decode(data)


def decode_event(data: bytes) -> Event:
    return _event.decode(data)


def recover_job_id(data: bytes, key: bytes | None = None) -> str | None:
    """Best effort: the id whose stream gets the `finished(rejected)` of a record that
    failed to decode as a Job: its `job_id` field when the record is a JSON object whose
    `job_id` can name a stream (`streamable_job_id`), else its Kafka `key` when that can
    (UTF-8); None otherwise. An id the wire refuses for a job (say `jöb-€`, outside
    `JOB_ID_PATTERN`) still names its stream, so a producer waiting on it hears why."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        obj = None
    if isinstance(obj, dict) and (jid := streamable_job_id(obj.get("job_id"))):
        return jid
    if key:
        try:
            return streamable_job_id(key.decode("utf-8"))
        except UnicodeDecodeError:
            return None
    return None


def streamable_job_id(jid: object) -> str | None:
    """`jid` if it can name a job's stream, else None: text of 1 to `JOB_ID_MAX_LENGTH`
    characters with no control character. Redis keys and channels are binary-safe and the
    id is the last segment of its keys (after the tenant's), so no ACL pattern changes
    with it; a control character could forge log lines and terminal output where the id
    is shown, and an empty or over-long id is no name a producer sent on purpose. Ids
    outside this set get no event: their record goes to the DLQ only
    (docs/concepts.md)."""
    if (isinstance(jid, str) and 0 < len(jid) <= JOB_ID_MAX_LENGTH
            and not any(unicodedata.category(c) == "Cc" for c in jid)):
        return jid
    return None


def recover_tenant(data: bytes) -> str | None:
    """Best effort, as `recover_job_id`: the `tenant` of an invalid record if it is a
    valid tenant id (else None: its rejection goes to the stream of jobs without one)."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    tenant = obj.get("tenant") if isinstance(obj, dict) else None
    try:
        return check_tenant(tenant) if isinstance(tenant, str) else None
    except ValueError:
        return None


def json_schemas() -> dict:
    """JSON Schema of every wire message, for producers in other languages."""
    (job, cancel, event), defs = msgspec.json.schema_components([Job, Cancel, Event])
    return {"job": job, "cancel": cancel, "event": event, "$defs": defs}
