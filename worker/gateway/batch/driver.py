"""Drives one batch to a terminal status: validate the input file, produce each valid
line as a job on the batch's priority topic, collect the outcomes, write the output and
error files. Exactly one gateway drives a batch at a time (a lease in Redis, renewed
every third of `gateway.batch_lease_ms`); another adopts it when the lease lapses.

Outcomes come from the durable results topic (`worker.serve.results`: every terminal event is
written there before a worker commits the job's offset), read from the offsets recorded
in the manifest before the first line was produced, so a worker killed with -9 (its jobs
re-run elsewhere), a Redis that restarts empty, or a gateway that restarts and re-reads
from the start all end with every line's outcome exactly once. Compaction keeps the last
record of each job id, so a job finished twice still reads as one outcome, keyed by its
line's custom_id.

Recovery: the manifest's dispatch cursor says which lines were produced; a line whose
outcome is already recorded is never produced again, and one produced again anyway (the
gateway died after producing a chunk, before recording the cursor) is the same job id,
which a worker does not run twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from schemas import keys
from schemas.codec import decode_event
from schemas.wire import Finished
from worker.gateway.batch.lines import (
    BatchLine,
    failed_line,
    invalid_line,
    line_job,
    output_line,
    parse_input,
    unanswered_line,
)
from worker.gateway.batch.state import BatchStore, Manifest
from worker.gateway.context import GatewayContext
from worker.gateway.files import FileStore
from worker.gateway.protocol import ENDPOINT_KINDS
from worker.obs.stopping import honour_cancellation, stop_within
from worker.security.kafka import kafka_security_kwargs, stop_client

log = structlog.get_logger(__name__)

DISPATCH_CHUNK = 256  # lines produced between two cursor checkpoints
PUBLISH_INTERVAL_S = 0.5  # live counts to Redis at most this often
MAX_LISTED_ERRORS = 100  # invalid lines listed in the batch object (all are in the error file)


class LeaseLost(Exception):
    """Another gateway drives the batch now."""


class BatchDriver:
    """Drives one batch to a terminal status while this gateway holds its lease.

    Args:
        ctx: the gateway context (Kafka/Redis client, settings, metrics, cancel sender).
        store: batch state.
        files: file store.
        manifest: the batch's manifest as loaded.
        token: this driver's lease token.
    """

    def __init__(self, ctx: GatewayContext, store: BatchStore, files: FileStore, manifest: Manifest,
                 token: str) -> None:
        self.ctx = ctx
        self.store = store
        self.files = files
        self.m = manifest
        self.token = token
        self.lines: list[BatchLine] = []
        self.by_job: dict[str, BatchLine] = {}
        self.outcomes: dict[str, Finished] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._lost = False
        self._last_publish = 0.0
        self._prefix = f"{manifest.batch.id}-".encode()  # results keys of this batch's jobs

    @property
    def batch_id(self) -> str:
        return self.m.batch.id

    async def run(self) -> None:
        """Drive until a terminal status (or until the lease is lost)."""
        renew = asyncio.create_task(self._renew_loop())
        try:
            await self._run()
        except LeaseLost:
            log.warning("batch lease lost; another gateway drives it now", batch_id=self.batch_id)
        finally:
            renew.cancel()
            if self._consumer is not None:
                await stop_client(self._consumer, "batch results", timeout_s=10)
            if not self._lost:
                await stop_within(f"batch {self.batch_id}: release its lease",
                                  self.store.release_lease(self.batch_id, self.token), 5)

    async def _renew_loop(self) -> None:
        while True:
            honour_cancellation()  # a renewal whose client swallowed the stop's cancel ends here
            await asyncio.sleep(self.store.lease_ms / 3000)
            try:
                if not await self.store.renew_lease(self.batch_id, self.token):
                    self._lost = True
                    return
            except Exception as e:  # Redis down: nobody else can take it either; keep going
                log.warning("could not renew the batch lease", batch_id=self.batch_id, error=repr(e)[:200])

    def _check_lease(self) -> None:
        if self._lost:
            raise LeaseLost()

    async def _run(self) -> None:
        m, b = self.m, self.m.batch
        kind = ENDPOINT_KINDS[b.endpoint]
        data = await asyncio.to_thread(self.files.read_content, b.input_file_id)
        self.lines, invalid = await asyncio.to_thread(parse_input, data, batch_id=b.id, endpoint=b.endpoint,
                                                      kind=kind, model_name=self.ctx.cfg.model_name,
                                                      tokenizer=self.ctx.tokens.tokenizer,
                                                      max_model_len=self.ctx.max_model_len, formats=self.ctx.formats)
        self.by_job = {line.job_id: line for line in self.lines}
        if b.status == "validating" and not await self._validate(invalid):
            return
        await self._open_results()
        await self._collect(catch_up=True)
        cancel_deadline = (b.cancelling_at or 0) + self.ctx.cfg.batch_cancel_grace_s
        if b.status == "cancelling":  # adopted mid-cancel: the cancels may not all have gone out
            self._cancel_unfinished("batch_cancelled")
        while not b.is_terminal:
            self._check_lease()
            now = time.time()
            if b.status == "finalizing":
                await self._finalize(m.final_status or "completed")
            elif b.expires_at is not None and now >= b.expires_at and b.status in ("in_progress", "cancelling"):
                self._cancel_unfinished("batch_expired")
                await self._finalize("expired")
            elif b.status == "in_progress" and await asyncio.to_thread(self.files.cancel_requested, b.id):
                b.status, b.cancelling_at = "cancelling", int(now)
                cancel_deadline = now + self.ctx.cfg.batch_cancel_grace_s
                await self.store.save(m)
                self._cancel_unfinished("batch_cancelled")
            elif b.status == "cancelling":
                dispatched = self.lines[:m.dispatched]
                if all(line.job_id in self.outcomes for line in dispatched) or now >= cancel_deadline:
                    await self._finalize("cancelled")
            elif b.status == "in_progress":
                if m.dispatched < len(self.lines):
                    await self._dispatch()
                elif len(self.outcomes) == len(self.lines):
                    await self._finalize("completed")
            if not b.is_terminal:
                dispatching = b.status == "in_progress" and m.dispatched < len(self.lines)
                await self._collect(timeout_ms=0 if dispatching else 500)
                await self._publish_counts()

    async def _validate(self, invalid) -> bool:
        """Record the validation: in_progress with the results offsets, or failed."""
        m, b = self.m, self.m.batch
        m.invalid = invalid
        now = int(time.time())
        b.request_counts.total = len(self.lines) + len(invalid)
        b.request_counts.failed = len(invalid)
        if invalid:
            b.errors = {"object": "list", "data": [{"code": e.code, "message": e.message, "param": e.param,
                                                    "line": e.line} for e in invalid[:MAX_LISTED_ERRORS]]}
        if b.request_counts.total > self.ctx.cfg.max_batch_lines or not self.lines:
            why = (f"the input file has {b.request_counts.total} lines, over gateway.max_batch_lines "
                   f"({self.ctx.cfg.max_batch_lines})" if self.lines else "the input file has no valid line")
            data = (b.errors or {}).get("data", [])
            b.errors = {"object": "list", "data": [{"code": "invalid_file", "message": why, "param": None,
                                                    "line": None}] + data}
            b.status, b.failed_at = "failed", now
            await self.store.save(m)
            self.ctx.metrics.batch_lines.labels("invalid").inc(len(invalid))
            return False
        topic = keys.results_topic(self.ctx.client.topic_prefix)
        parts = sorted(await self.ctx.client.partitions_for(topic))
        if not parts:
            raise RuntimeError(f"results topic {topic!r} does not exist (inflight topics create)")
        await self._open_results()
        ends = await self._consumer.end_offsets([TopicPartition(topic, p) for p in parts])
        m.results_start = {tp.partition: off for tp, off in ends.items()}
        b.status, b.in_progress_at = "in_progress", now
        await self.store.save(m)
        self.ctx.metrics.batch_lines.labels("invalid").inc(len(invalid))
        return True

    async def _open_results(self) -> None:
        if self._consumer is not None:
            return
        kc = self.ctx.client.kafka_config
        topic = keys.results_topic(self.ctx.client.topic_prefix)
        consumer = AIOKafkaConsumer(bootstrap_servers=kc.bootstrap_servers, group_id=None, enable_auto_commit=False,
                                    client_id=f"gateway-batch-{self.batch_id}", **kafka_security_kwargs(kc))
        await consumer.start()
        self._consumer = consumer
        parts = sorted(await self.ctx.client.partitions_for(topic))
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        start = self.m.results_start or {}
        begins = await consumer.beginning_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(start.get(tp.partition, 0), begins[tp]))

    async def _collect(self, catch_up: bool = False, timeout_ms: int = 500) -> None:
        """Read outcomes: one poll waiting up to `timeout_ms`, or with `catch_up` up to
        the topic's end offsets now."""
        c = self._consumer
        ends = await c.end_offsets(list(c.assignment())) if catch_up else None
        while True:
            honour_cancellation()
            got = await c.getmany(timeout_ms=200 if catch_up else timeout_ms, max_records=5000)
            for recs in got.values():
                for rec in recs:
                    if rec.key and rec.value and rec.key.startswith(self._prefix):
                        job_id = rec.key.decode()
                        ev = decode_event(rec.value)
                        if isinstance(ev, Finished) and job_id in self.by_job:
                            self.outcomes[job_id] = ev
            if not catch_up:
                return
            positions = {tp: await c.position(tp) for tp in ends}
            if all(positions[tp] >= end for tp, end in ends.items()):
                return

    async def _dispatch(self) -> None:
        m = self.m
        chunk = self.lines[m.dispatched:m.dispatched + DISPATCH_CHUNK]
        deadline = float(m.batch.expires_at or time.time() + 86400)
        jobs = [line_job(line, m.tenant, deadline, m.batch.id) for line in chunk if line.job_id not in self.outcomes]
        try:
            await asyncio.gather(*(self.ctx.client.submit_job(j, m.priority) for j in jobs))
        except KafkaError as e:
            log.warning("could not produce batch lines; retrying", batch_id=m.batch.id, error=repr(e)[:200])
            await asyncio.sleep(1.0)
            return
        self._check_lease()
        m.dispatched += len(chunk)
        await self.store.save(m)
        self.ctx.metrics.batch_lines.labels("dispatched").inc(len(jobs))

    def _cancel_unfinished(self, reason: str) -> None:
        for line in self.lines[:self.m.dispatched]:
            if line.job_id not in self.outcomes:
                self.ctx.cancels.send(line.job_id, reason)

    async def _publish_counts(self) -> None:
        now = time.monotonic()
        if now - self._last_publish < PUBLISH_INTERVAL_S:
            return
        self._last_publish = now
        counts = self.m.batch.request_counts
        done = [self.outcomes[line.job_id] for line in self.lines if line.job_id in self.outcomes]
        counts.completed = sum(1 for f in done if f.finish_reason.is_success)
        counts.failed = len(self.m.invalid) + len(done) - counts.completed
        self._check_lease()
        await self.store.publish(self.m)

    async def _finalize(self, status: str) -> None:
        """Write the output and error files (fixed ids: finalizing twice rewrites them),
        then the terminal status."""
        self._check_lease()
        m, b = self.m, self.m.batch
        now = int(time.time())
        if b.status != "finalizing":
            m.final_status, b.status, b.finalizing_at = status, "finalizing", now
            await self.store.save(m)
        out, errors = [], [invalid_line(e) for e in m.invalid]
        usage = {"input_tokens": 0, "output_tokens": 0, "cached": 0}
        unanswered = {"cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
                      "expired": ("batch_expired", "the batch's completion window passed before this request ran"),
                      "completed": ("no_outcome", "no outcome was recorded for this request")}[status]
        for line in self.lines:
            fin = self.outcomes.get(line.job_id)
            if fin is not None and fin.usage is not None:
                usage["input_tokens"] += fin.usage.prompt_tokens
                usage["output_tokens"] += fin.usage.completion_tokens
                usage["cached"] += fin.usage.cached_prompt_tokens
            if fin is not None and fin.finish_reason.is_success:
                out.append(output_line(line, fin, self.ctx.cfg.model_name, now, self.ctx.formats))
            elif fin is not None and fin.finish_reason.value not in ("cancelled", "expired"):
                errors.append(failed_line(line, fin))
            else:
                errors.append(unanswered_line(line, *unanswered))
        b.output_file_id = await self._write_file("output", out) if out else None
        b.error_file_id = await self._write_file("error", errors) if errors else None
        b.request_counts.completed, b.request_counts.failed = len(out), len(errors)
        b.usage = {"input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"],
                   "total_tokens": usage["input_tokens"] + usage["output_tokens"],
                   "input_tokens_details": {"cached_tokens": usage["cached"]},
                   "output_tokens_details": {"reasoning_tokens": 0}}
        b.status = status
        setattr(b, {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[status], now)
        self._check_lease()
        await self.store.save(m)
        met = self.ctx.metrics.batch_lines
        met.labels("completed").inc(len(out))
        met.labels("failed").inc(len(errors) - len(m.invalid))
        log.info("batch finished", batch_id=b.id, status=status, completed=len(out), failed=len(errors),
                 lines=b.request_counts.total)

    async def _write_file(self, what: str, rows: list[dict]) -> str:
        file_id = "file-" + hashlib.sha256(f"{self.batch_id}:{what}".encode()).hexdigest()[:24]
        data = b"".join(msgspec.json.encode(r) + b"\n" for r in rows)
        await asyncio.to_thread(self.files.create_file, data, filename=f"{self.batch_id}_{what}.jsonl",
                                purpose="batch_output", tenant=self.m.tenant, file_id=file_id)
        return file_id
