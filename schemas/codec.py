"""Encoders/decoders, built once. `decode_job` and friends raise `msgspec.DecodeError`
(not JSON) or `msgspec.ValidationError` (wrong type, missing field, bad value, unknown
`v`), with the field path in the message."""


from __future__ import annotations

import msgspec

from schemas.wire import Cancel, Event, Job, check_tenant

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


def recover_job_id(data: bytes) -> str | None:
    """Best effort: the `job_id` of a record that failed to decode as a Job, if it is
    a JSON object with a string `job_id` (so the producer still gets `finished(rejected)`)."""
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    if isinstance(obj, dict):
        jid = obj.get("job_id")
        if isinstance(jid, str) and 0 < len(jid) <= 200:
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
