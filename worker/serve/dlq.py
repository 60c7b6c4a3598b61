"""Dead letters: one rule for every layer. A job record that will never run — it does not
decode or validate (`invalid_job`), the engine refuses it (`empty_prompt`,
`prompt_too_long`, `exceeds_context`, `exceeds_kv_capacity`, `invalid_params`,
`invalid_prompt`, `overloaded`, …), or it kept killing workers (`poison`) — goes to
`<prefix>.dlq` with its original key and value bytes untouched; the reason code, the
message and where it came from travel in the record headers (as Kafka Connect's DLQ),
so an operator counts rejects by reason from the DLQ alone. Jobs that end `expired` or
`cancelled` before running are outcomes their producer asked for, not dead letters.

The send completes before the record's offset may be committed (at-least-once).
"""

from __future__ import annotations

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from schemas import keys
from schemas.wire import (
    DLQ_HEADER_ERROR,
    DLQ_HEADER_JOB_ID,
    DLQ_HEADER_REASON,
    DLQ_HEADER_SOURCE_OFFSET,
    DLQ_HEADER_SOURCE_PARTITION,
    DLQ_HEADER_SOURCE_TOPIC,
    DLQ_HEADER_WORKER_ID,
)
from worker.security.access import raise_if_refused

MAX_ERROR_BYTES = 4096


class DeadLetters:
    """Writes dead letters through the worker's producer. `num_sent` counts them."""

    def __init__(self, producer: AIOKafkaProducer, topic_prefix: str, worker_id: str) -> None:
        self.producer = producer
        self.topic = keys.dlq_topic(topic_prefix)
        self.worker_id = worker_id
        self.num_sent = 0

    async def send(self, value: bytes | None, key: bytes | None, *, topic: str, partition: int, offset: int,
                   reason: str, error: str, job_id: str | None = None) -> None:
        """Produce one dead letter and wait for the broker's acknowledgement.

        Args:
            value, key: the original record's bytes.
            topic, partition, offset: where the record came from.
            reason: machine-readable code (header `inflight.reason`).
            error: human-readable message (header `inflight.error`, cut at 4 KiB).
            job_id: when one could be read from the record.

        Raises:
            aiokafka.errors.KafkaError: the broker did not take it (the caller keeps the
                record's offset open, so it is retried after a restart).
            worker.security.access.Refused: the principal may not write the DLQ (retrying cannot
                help; the worker stops with the cause).
        """
        headers = [
            (DLQ_HEADER_REASON, reason.encode()),
            (DLQ_HEADER_ERROR, error.encode()[:MAX_ERROR_BYTES]),
            (DLQ_HEADER_SOURCE_TOPIC, topic.encode()),
            (DLQ_HEADER_SOURCE_PARTITION, str(partition).encode()),
            (DLQ_HEADER_SOURCE_OFFSET, str(offset).encode()),
            (DLQ_HEADER_WORKER_ID, self.worker_id.encode()),
        ]
        if job_id:
            headers.append((DLQ_HEADER_JOB_ID, job_id.encode()))
        try:
            await self.producer.send_and_wait(self.topic, value=value, key=key, headers=headers)
        except KafkaError as e:
            raise_if_refused(e)
            raise
        self.num_sent += 1
