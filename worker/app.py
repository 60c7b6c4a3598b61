"""Worker: wires intake, engine thread, publisher and cancel listener.

Lifecycle (as arq): start → run → drain(deadline) → close. SIGTERM/SIGINT stop intake
(all partitions paused, polling continues), let running jobs finish until
`worker.drain_timeout_s`, hand the rest back (aborted without a terminal event, claims
released, offsets left uncommitted so another worker re-runs them with `restarted`),
commit, leave the group, close.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from functools import partial

import redis.asyncio as aioredis
import structlog
from aiokafka import TopicPartition
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas import keys
from schemas.wire import ErrorInfo, Job, Timings, TokenLogprob, Usage
from worker.cancels import CancelListener
from worker.config import WorkerConfig, redacted_config
from worker.engine import Engine, RequestOutput, RequestRejected
from worker.engine_thread import EngineThread
from worker.intake import Intake
from worker.jobs import JobRecord, LocalJob
from worker.log import task_stacks
from worker.metrics import Metrics
from worker.offsets import OffsetTracker
from worker.publish import JobStream, Publisher
from worker.server import Checks, OpsServer

log = structlog.get_logger(__name__)

_RESTART_REASON = "the previous attempt did not finish (worker stopped or handed the job back)"

_RENEW_IF_OWNER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end
"""


class Worker:
    def __init__(self, cfg: WorkerConfig, engine: Engine | None = None) -> None:
        self.cfg = cfg
        self.worker_id = cfg.worker.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.engine = engine
        tuning = cfg.serving_tuning
        self.max_local_jobs = cfg.worker.max_local_jobs or 2 * tuning.max_running_requests
        self.jobs: dict[str, LocalJob] = {}
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self.draining = False
        self._stop_requested = asyncio.Event()
        self._stopping = asyncio.Event()
        self._out_q: asyncio.Queue = asyncio.Queue()
        self._crash: BaseException | None = None
        self._tasks: list[asyncio.Task] = []
        self._prefix = cfg.redis.key_prefix
        self.num_finished = 0
        self.metrics = Metrics(gpu=_nvml_available())
        self.checks = Checks()
        self.server: OpsServer | None = None
        if cfg.metrics.port is not None:
            self.server = OpsServer(self, cfg.metrics.host, cfg.metrics.port)
        self.engine_thread: EngineThread | None = None

    @property
    def num_local_jobs(self) -> int:
        return len(self.jobs)

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        log.info("starting worker", worker_id=self.worker_id, config=redacted_config(cfg))
        if self.server is not None:  # first, so /healthz answers while the model loads
            await self.server.start()
        self.redis = aioredis.from_url(
            cfg.redis.url,
            health_check_interval=15,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 8),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
        )
        await self.redis.ping()
        self.publisher = Publisher(self.redis, cfg.redis)
        await self.publisher.load_scripts()
        if self.engine is None:
            self.engine = await asyncio.to_thread(Engine.from_pretrained, cfg.model.path, cfg.engine)
        loop = asyncio.get_running_loop()
        self.engine_thread = EngineThread(self.engine, loop, self._on_step, self._on_crash, self.metrics)
        self.engine_thread.start()
        self.intake = Intake(self)
        await self.intake.start()
        self.cancels = CancelListener(self)
        await self.cancels.start()
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="publisher"),
            asyncio.create_task(self.intake.run(self._stopping), name="intake"),
            asyncio.create_task(self.cancels.run(self._stopping), name="cancels"),
            asyncio.create_task(self._renew_loop(), name="claims"),
            asyncio.create_task(self._check_loop(), name="checks"),
        ]
        log.info("worker started", worker_id=self.worker_id, max_local_jobs=self.max_local_jobs,
                 kv_blocks=self.engine.kv_stats().total_blocks)

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def run(self, install_signals: bool = True) -> None:
        """Start, serve until SIGTERM/SIGINT (or `request_stop`), drain, close."""
        await self.start()
        if install_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            loop.add_signal_handler(signal.SIGUSR1, self.dump_tasks)
        try:
            waiter = asyncio.create_task(self._stop_requested.wait())
            done, _ = await asyncio.wait([waiter, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not waiter and t.exception() is not None:
                    log.error("worker task failed; stopping", task=t.get_name(), exc_info=t.exception())
                    raise t.exception()
            await self.drain()
        finally:
            await self.close()
        if self._crash is not None:
            raise self._crash

    # ---- health ----------------------------------------------------------------------------
    def liveness(self) -> tuple[bool, dict]:
        """(alive, details) for /healthz: the engine thread runs and ticked within
        `metrics.engine_stall_s`. True while the model is still loading."""
        et = self.engine_thread
        if self._crash is not None:
            return False, {"status": "crashed", "error": repr(self._crash)[:300]}
        if et is None:
            return True, {"status": "starting"}
        since = time.monotonic() - et.last_step_time
        if not et.alive:
            return False, {"status": "engine thread stopped"}
        if since > self.cfg.metrics.engine_stall_s:
            return False, {"status": "engine loop stalled", "since_last_tick_s": round(since, 1)}
        return True, {"status": "ok", "since_last_tick_s": round(since, 3), "steps": et.num_steps}

    def readiness(self) -> tuple[bool, dict]:
        """(ready, details) for /readyz: model loaded, Kafka and Redis answered the last
        check, not draining."""
        c = self.checks
        checks = {
            "model_loaded": self.engine_thread is not None,
            "kafka": c.kafka_ok,
            "redis": c.redis_ok,
            "not_draining": not self.draining and not self._stop_requested.is_set(),
        }
        ready = all(checks.values())
        body: dict = {"status": "ready" if ready else "unready", "checks": checks}
        errors = {k: v for k, v in (("kafka", c.kafka_error), ("redis", c.redis_error)) if v}
        if errors:
            body["errors"] = errors
        return ready, body

    async def _check_loop(self) -> None:
        """Every `metrics.check_interval_s`: Redis PING, Kafka end offsets of the assigned
        job partitions (or cluster metadata when none are assigned); sets readiness and
        the lag / partition / GPU gauges."""
        mc = self.cfg.metrics
        while True:
            try:
                await self.run_checks(mc.check_timeout_s)
            except Exception as e:  # a check must never stop the worker (e.g. consumer being recreated)
                log.warning("health check failed", error=repr(e))
            await asyncio.sleep(mc.check_interval_s)

    async def run_checks(self, timeout: float) -> None:
        c, m = self.checks, self.metrics
        try:
            await asyncio.wait_for(self.redis.ping(), timeout)
            c.redis_ok, c.redis_error = True, None
        except Exception as e:
            c.redis_ok, c.redis_error = False, repr(e)[:200]
        intake = self.intake
        consumer = intake.consumer
        assigned = sorted(consumer.assignment(), key=lambda tp: (tp.topic, tp.partition))
        try:
            if assigned:
                ends = await asyncio.wait_for(consumer.end_offsets(assigned), timeout)
                lags = intake.lag(ends)
                m.consumer_lag.clear()
                for tp, lag in lags.items():
                    m.consumer_lag.labels(tp.topic, str(tp.partition)).set(lag)
            else:
                await asyncio.wait_for(consumer.topics(), timeout)
                m.consumer_lag.clear()
            c.kafka_ok, c.kafka_error = True, None
        except Exception as e:
            c.kafka_ok, c.kafka_error = False, repr(e)[:200] or type(e).__name__
        m.assigned_partitions.set(len(assigned))
        m.paused_partitions.set(len(consumer.paused()))
        m.local_jobs.set(len(self.jobs))
        if m.gpu_utilization is not None and self.engine is not None:
            with contextlib.suppress(Exception):  # an NVML hiccup keeps the last value
                m.gpu_utilization.set(torch_gpu_utilization(self.engine.runner.device) / 100.0)

    def dump_tasks(self) -> None:
        """SIGUSR1: log where every asyncio task is waiting (for diagnosing a stuck worker)."""
        for name, frames in task_stacks().items():
            log.warning("task stack", task=name, frames=frames)

    async def drain(self) -> None:
        self.draining = True
        deadline = time.monotonic() + self.cfg.worker.drain_timeout_s
        log.info("draining", running=len(self.jobs), deadline_s=self.cfg.worker.drain_timeout_s)
        while self.jobs and time.monotonic() < deadline and self._crash is None:
            await asyncio.sleep(0.05)
        handed = [lj for lj in self.jobs.values() if not lj.stream.finished]
        for lj in handed:
            lj.handed_back = True
            self.engine.abort(lj.job_id)
            self.metrics.aborted.labels("handed_back").inc()
        self.engine_thread.wake()
        if handed:
            await self.publisher.release_claims({lj.job_id: lj.stream.claim_token for lj in handed})
            log.info("handed back unfinished jobs", job_ids=[lj.job_id for lj in handed])
        await self._out_q.join()

    async def close(self) -> None:
        """Stop every component; each step is bounded so a broken connection cannot hang shutdown."""
        self._stopping.set()
        for t in self._tasks:
            if t.get_name() in ("intake", "cancels", "claims", "checks"):
                t.cancel()
        await asyncio.gather(*self._tasks[1:], return_exceptions=True)
        for name, coro in (("intake", self.intake.stop()), ("cancels", self.cancels.stop())):
            try:
                await asyncio.wait_for(coro, 15)
            except Exception as e:  # keep closing the rest
                log.warning("component did not stop cleanly", component=name, error=repr(e))
        self._tasks[0].cancel()
        await asyncio.gather(self._tasks[0], return_exceptions=True)
        self.engine_thread.stop()
        await self.redis.aclose()
        if self.server is not None:
            await self.server.stop()
        log.info("worker stopped", worker_id=self.worker_id, finished=self.num_finished)

    # ---- Redis helpers used by intake ----------------------------------------------------
    async def is_done(self, job_id: str) -> bool:
        return bool(await self.redis.exists(keys.done_key(job_id, self._prefix)))

    async def try_claim(self, job_id: str) -> str | None:
        """SET NX with a lease; returns the claim token, or None if another worker holds it."""
        token = f"{self.worker_id}:{uuid.uuid4().hex[:12]}"
        ok = await self.redis.set(keys.claim_key(job_id, self._prefix), token, nx=True,
                                  px=self.cfg.redis.claim_lease_ms)
        return token if ok else None

    async def _open_stream(self, job_id: str, claim: str) -> JobStream:
        p = self._prefix
        pipe = self.redis.pipeline(transaction=False)
        pipe.incr(keys.attempts_key(job_id, p))
        pipe.expire(keys.attempts_key(job_id, p), self.cfg.redis.log_ttl_s)
        attempt, _ = await pipe.execute()
        return JobStream(job_id, int(attempt), await self.publisher.last_seq(job_id) + 1, claim)

    def _emit(self, events: list, claims: dict[str, str] | None = None, finished: list[LocalJob] | None = None) -> None:
        self._out_q.put_nowait((events, claims or {}, finished or []))

    # ---- job start ---------------------------------------------------------------------
    async def start_job(self, job: Job, priority: str, tp: TopicPartition, offset: int, enqueue: float,
                        claim: str) -> None:
        jid = job.job_id
        p = self._prefix
        if await self.redis.exists(keys.cancelled_key(jid, p)):
            await self.finish_without_running(jid, claim, "cancelled", None, None, [(tp, offset)], job.metadata)
            return
        if job.deadline is not None and job.deadline < time.time():
            await self.finish_without_running(jid, claim, "expired", "deadline_passed",
                                              f"deadline {job.deadline} passed before the job started", [(tp, offset)],
                                              job.metadata)
            return
        stream = await self._open_stream(jid, claim)
        lj = LocalJob(job, priority, stream, [(tp, offset)], enqueue)
        self.jobs[jid] = lj
        kwargs = {"params": job.params, "priority": priority, "cache_salt": job.tenant or "", "arrival_time": enqueue,
                  "deadline": job.deadline}
        if job.prompt is not None:
            kwargs["prompt"] = job.prompt
        elif job.messages is not None:
            kwargs["messages"] = [{"role": m.role, "content": m.content} for m in job.messages]
        else:
            kwargs["prompt_token_ids"] = job.prompt_token_ids
        try:
            # tokenization and chat templates run off the event loop
            await asyncio.get_running_loop().run_in_executor(None, partial(self.engine.add_request, jid, **kwargs))
        except RequestRejected as e:  # never started: no `started` event, only the terminal one
            lj.started = True
            if stream.attempt > 1:
                self._emit([stream.restarted(_RESTART_REASON)])
            self.metrics.rejected.labels(e.reason.value).inc()
            self._finish_local(lj, "rejected", error=ErrorInfo(code=e.reason.value, message=e.message))
            return
        lj.in_engine = True
        # `started` goes out now unless the engine's first output for the job got here first
        # (`_on_step` emits it before that output): either way it precedes every token
        if not lj.started:
            self._emit(self._start_events(lj))
        if lj.cancel_requested:
            self.engine.abort(jid)
        self.engine_thread.wake()

    def _start_events(self, lj: LocalJob) -> list:
        """The job's opening events, made once: `restarted` on a later attempt, then `started`."""
        if lj.started:
            return []
        lj.started = True
        events = [lj.stream.restarted(_RESTART_REASON)] if lj.stream.attempt > 1 else []
        events.append(lj.stream.started(self.worker_id, max(0.0, lj.submit_time - lj.enqueue_time), lj.job.metadata))
        return events

    async def finish_without_running(self, job_id: str, claim: str, reason: str, code: str | None,
                                     message: str | None, offsets: list[tuple[TopicPartition, int]],
                                     metadata: dict | None = None) -> None:
        """Terminal event for a claimed job that never reaches the engine (cancelled
        before arrival, expired, rejected); `metadata` is echoed as on every terminal event."""
        stream = await self._open_stream(job_id, claim)
        lj = LocalJob(Job(job_id=job_id, prompt="", metadata=metadata), "normal", stream, offsets, time.time())
        self.jobs[job_id] = lj
        error = ErrorInfo(code=code, message=message) if code else None
        self._finish_local(lj, reason, error=error)

    def _finish_local(self, lj: LocalJob, reason: str, error: ErrorInfo | None = None) -> None:
        self.metrics.finished.labels(reason).inc()
        ev = lj.stream.finished_event(reason, text="".join(lj.text_parts), error=error,
                                      usage=Usage(prompt_tokens=0, completion_tokens=0), metadata=lj.job.metadata)
        self._emit([ev], {lj.job_id: lj.stream.claim_token}, [lj])

    # ---- cancels -------------------------------------------------------------------------
    async def cancel(self, job_id: str) -> None:
        await self.redis.set(keys.cancelled_key(job_id, self._prefix), b"1", ex=self.cfg.redis.tombstone_ttl_s)
        lj = self.jobs.get(job_id)
        if lj is not None and not lj.stream.finished:
            lj.cancel_requested = True
            if lj.cancel_time is None:
                lj.cancel_time = time.monotonic()
            if lj.in_engine:
                self.engine.abort(job_id)
                self.engine_thread.wake()

    # ---- engine outputs → events ---------------------------------------------------------
    def _on_step(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        m = self.metrics
        events, claims, finished = [], {}, []
        for out in outputs:
            lj = self.jobs.get(out.request_id)
            if lj is None or lj.stream.finished:
                continue
            if lj.handed_back:
                continue
            if not lj.started:
                events.extend(self._start_events(lj))
            if out.new_token_ids or out.text:
                if lj.first_token_time is None:
                    lj.first_token_time = now
                    m.ttft.labels(lj.priority).observe(now - lj.enqueue_time)
                lj.num_tokens += len(out.new_token_ids)
                m.generation_tokens.inc(len(out.new_token_ids))
                lj.text_parts.append(out.text)
                lps = [TokenLogprob(token_id=x.token_id, logprob=x.logprob, top_token_ids=x.top_token_ids,
                                    top_logprobs=x.top_logprobs) for x in out.logprobs] if out.logprobs else None
                events.append(lj.stream.token(out.text, out.new_token_ids, lps))
            if out.finished:
                events.append(self._finished_event(lj, out, now))
                claims[lj.job_id] = lj.stream.claim_token
                finished.append(lj)
        if events:
            self._emit(events, claims, finished)

    def _finished_event(self, lj: LocalJob, out: RequestOutput, now: float):
        """The terminal event of a job that ran in the engine; records its metrics."""
        m = self.metrics
        reason = out.finish_reason or "error"
        e2e = now - lj.enqueue_time
        ttft = lj.first_token_time - lj.enqueue_time if lj.first_token_time else None
        tpot = ((now - lj.first_token_time) / (lj.num_tokens - 1)
                if lj.first_token_time and lj.num_tokens > 1 else None)
        queue = out.times.queue_s if out.times is not None else None
        u = out.usage
        m.finished.labels(reason).inc()
        m.e2e.labels(lj.priority).observe(e2e)
        if tpot is not None:
            m.tpot.labels(lj.priority).observe(tpot)
        if queue is not None:
            m.queue_time.labels(lj.priority).observe(queue)
        if u is not None:
            m.prompt_tokens.inc(u.prompt_tokens)
        if reason == "cancelled":
            m.aborted.labels("cancelled").inc()
            if lj.cancel_time is not None:
                m.cancel_to_free.observe(time.monotonic() - lj.cancel_time)
        error = ErrorInfo(code=out.error_code, message=out.error_message or "") if out.error_code else None
        lj.summary = {
            "queue_s": _r(queue), "ttft_s": _r(ttft), "tpot_s": _r(tpot), "e2e_s": _r(e2e),
            "tokens_per_s": _r(lj.num_tokens / (now - lj.first_token_time))
            if lj.first_token_time and now > lj.first_token_time else None,
            "prompt_tokens": u.prompt_tokens if u else None,
            "cached_prompt_tokens": u.cached_prompt_tokens if u else None,
            "preemptions": out.num_preemptions,
        }
        if error is not None:
            lj.summary["error_code"] = error.code
        return lj.stream.finished_event(
            reason,
            text="".join(lj.text_parts),
            error=error,
            usage=Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                        cached_prompt_tokens=u.cached_prompt_tokens) if u else None,
            timings=Timings(queue_s=queue, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e),
            metadata=lj.job.metadata,
        )

    def _on_crash(self, exc: BaseException) -> None:
        self._crash = exc
        self.request_stop()

    async def _publish_loop(self) -> None:
        """Single writer of events: pipelines go out in step order."""
        q = self._out_q
        while True:
            batches = [await q.get()]
            while not q.empty():
                batches.append(q.get_nowait())
            events = [e for b in batches for e in b[0]]
            claims = {k: v for b in batches for k, v in b[1].items()}
            try:
                await self.publisher.publish(events, claims)
            except Exception:
                log.exception("publishing events failed; stopping the worker (jobs will be redelivered)")
                for _ in batches:
                    q.task_done()
                self._on_crash(RuntimeError("Redis unavailable"))
                return
            for b in batches:
                for lj in b[2]:
                    self._job_done(lj)
                q.task_done()

    def _job_done(self, lj: LocalJob) -> None:
        self.jobs.pop(lj.job_id, None)
        for tp, off in lj.offsets:
            self.tracker.done(tp, off)
        self.num_finished += 1
        first_tp, first_off = lj.offsets[0]
        log.info(
            "job finished", job_id=lj.job_id, topic=first_tp.topic, partition=first_tp.partition, offset=first_off,
            finish_reason=lj.stream.finish_reason, attempt=lj.stream.attempt, priority=lj.priority, tokens=lj.num_tokens,
            **lj.summary,
        )

    async def _renew_loop(self) -> None:
        lease = self.cfg.redis.claim_lease_ms
        while True:
            await asyncio.sleep(lease / 3000)
            held = [lj for lj in self.jobs.values() if not lj.stream.finished and not lj.handed_back]
            if not held:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for lj in held:
                pipe.eval(_RENEW_IF_OWNER, 1, keys.claim_key(lj.job_id, self._prefix), lj.stream.claim_token, lease)
            results = await pipe.execute()
            for lj, ok in zip(held, results):
                if lj.stream.finished or lj.handed_back:
                    continue  # it ended (or was handed back) while the renewals were in flight
                if not ok:  # lease lost (we stalled past it): another worker may run the job now
                    log.warning("claim lost; handing the job back", job_id=lj.job_id)
                    lj.handed_back = True
                    self.engine.abort(lj.job_id)
                    self.metrics.aborted.labels("lease_lost").inc()
                    self.jobs.pop(lj.job_id, None)
                    # keep its offsets open until the job's terminal event appears, as for
                    # any record whose job another worker holds
                    self.intake.contested.extend(
                        JobRecord(lj.job, lj.priority, tp, off, lj.enqueue_time) for tp, off in lj.offsets)
            self.engine_thread.wake()



def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _nvml_available() -> bool:
    """CUDA present and NVML importable (then `gpu_utilization` is exported)."""
    try:
        import pynvml  # noqa: F401  (nvidia-ml-py)
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def torch_gpu_utilization(device) -> int:
    """Percent of time the GPU was busy over the last sample period (NVML via torch)."""
    import torch

    return torch.cuda.utilization(device)
