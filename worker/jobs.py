"""Local state of the jobs a worker holds (claimed, running in the engine)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from schemas.wire import Job
from worker.publish import JobStream


@dataclass(slots=True, eq=False)
class LocalJob:
    """A claimed job. `offsets` are every Kafka record this job answers (a redelivery
    that reaches the same worker while the job runs is attached here); they are marked
    done once the terminal event is in Redis. Times are Unix seconds."""

    job: Job
    priority: str
    stream: JobStream
    offsets: list[tuple[TopicPartition, int]]
    enqueue_time: float
    submit_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    num_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    started: bool = False  # the `started` event is made (or the job was rejected and never starts)
    cancel_requested: bool = False
    cancel_time: float | None = None  # time.monotonic() when the cancel arrived (cancel-to-free latency)
    handed_back: bool = False
    in_engine: bool = False
    summary: dict = field(default_factory=dict)  # timings and usage for the job's summary log line

    @property
    def job_id(self) -> str:
        return self.job.job_id


@dataclass(slots=True, eq=False)
class JobRecord:
    """A decoded job record: the job with its partition, offset and enqueue time (Unix
    seconds). Kept in `Intake.contested` while another live worker holds the job's claim:
    its offset stays open until that job ends (done key) or the claim expires (then this
    worker runs it)."""

    job: Job
    priority: str
    tp: TopicPartition
    offset: int
    enqueue_time: float
