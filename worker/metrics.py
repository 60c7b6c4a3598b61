"""Every Prometheus series of one worker, defined here and nowhere else (DESIGN §6).

Base units (seconds, tokens, ratios 0..1); labels are low-cardinality only: `priority`
(high/normal/low), `finish_reason`, `reason`, `outcome`, `code` (an engine ErrorCode), and
the Kafka `topic` / `partition` of the job topics (bounded by the partition count). Never
a job id.

One `Metrics` object per worker process, in its own `CollectorRegistry`, served on the
worker's `/metrics`. Several worker processes on one host each serve their own port
(`metrics.port`), and Prometheus tells them apart by target (`instance`/`pod` labels);
no multiprocess aggregation is done or needed, since one process owns one engine.

Writers: `observe_step` / `observe_idle` run on the engine thread after each step
(cost: 0.014–0.04 ms per step on the 2-core CPU box, `tools/bench_engine.py scheduler`);
everything else runs on the worker's asyncio loop. prometheus-client is thread-safe.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from worker.engine import KVStats, StepStats

# Bucket upper bounds, seconds. TTFT 1 ms–120 s, TPOT 1 ms–2 s, e2e 10 ms–600 s (DESIGN §6).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0,
                 120.0, 300.0, 600.0)
CANCEL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

PRIORITY = ("priority",)


class Metrics:
    """The worker's metrics. Args:
    registry: where to register (a fresh `CollectorRegistry` if None, so several
        workers in one test process do not collide).
    throughput_window_s: window of the `*_tokens_per_second` gauges, seconds.
    gpu: also export `gpu_utilization` (set True when NVML is present on a CUDA box).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, throughput_window_s: float = 10.0,
                 gpu: bool = False) -> None:
        r = self.registry = registry or CollectorRegistry()
        # ---- per request (asyncio loop) --------------------------------------------------
        self.queue_time = Histogram(
            "request_queue_time_seconds", "Enqueue (Kafka record timestamp) to first scheduled in the engine",
            PRIORITY, buckets=QUEUE_BUCKETS, registry=r)
        self.ttft = Histogram(
            "llm_ttft_seconds", "Time to first token: enqueue to the first token handed to the publisher",
            PRIORITY, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            "llm_tpot_seconds", "Mean time per output token after the first, per request with >= 2 tokens",
            PRIORITY, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(
            "llm_e2e_request_latency_seconds", "Enqueue to terminal event, per finished job",
            PRIORITY, buckets=E2E_BUCKETS, registry=r)
        self.finished = Counter(
            "request_finished", "Jobs ended with a terminal event, by finish reason", ("finish_reason",), registry=r)
        self.aborted = Counter(
            "request_abort", "Requests aborted in the engine, by reason (cancelled, handed_back, lease_lost)",
            ("reason",), registry=r)
        self.rejected = Counter(
            "request_rejected", "Jobs rejected before running, by reason (engine reject reason or invalid_job)",
            ("reason",), registry=r)
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens of finished requests (each counted once)", registry=r)
        self.generation_tokens = Counter(
            "generation_tokens", "Output tokens delivered to the publisher (never counted twice after preemption)",
            registry=r)
        self.cancel_to_free = Histogram(
            "cancel_to_free_seconds", "Cancel message received to the job's KV blocks freed by the engine",
            buckets=CANCEL_BUCKETS, registry=r)
        self.local_jobs = Gauge("local_jobs", "Jobs held by this worker (in the engine or about to enter it)",
                                registry=r)
        # ---- per step (engine thread) ----------------------------------------------------
        self.running = Gauge("running_requests", "Requests in the running batch", registry=r)
        self.waiting = Gauge("waiting_requests", "Requests waiting for admission (incl. preempted)", registry=r)
        self.kv_usage = Gauge("kv_cache_usage_ratio", "Used KV blocks / total KV blocks (0..1)", registry=r)
        self.kv_blocks = Gauge("kv_cache_blocks", "Total KV blocks of the paged cache", registry=r)
        self.prefill_tps = Gauge("prefill_tokens_per_second", "Prefill tokens computed per second (recent window)",
                                 registry=r)
        self.decode_tps = Gauge("decode_tokens_per_second", "Decode tokens computed per second (recent window)",
                                registry=r)
        self.preemptions = Counter("preemptions", "Requests preempted by recompute (KV blocks ran out)", registry=r)
        self.oom = Counter("request_oom", "Requests in a step that ran out of memory, by outcome (retried, failed)",
                           ("outcome",), registry=r)
        self.request_errors = Counter(
            "request_errors", "Requests the engine ended with finish_reason error, by code (internal: their "
            "forward raised alone or their output could not be produced; oom: out of memory after "
            "max_oom_retries)", ("code",), registry=r)
        self.failed_forwards = Counter(
            "engine_failed_forwards", "Forwards that raised: a whole batch, or one request retried alone "
            "after its batch failed (out of memory included)", registry=r)
        self.step_duration = Histogram("engine_step_duration_seconds", "Wall time of one engine step",
                                       buckets=STEP_BUCKETS, registry=r)
        self.step_host = Histogram("engine_host_seconds", "Host time of one engine step: its wall time minus the "
                                   "model runner's (scheduling, bookkeeping, output building)",
                                   buckets=STEP_BUCKETS, registry=r)
        self.gpu_utilization = (Gauge("gpu_utilization", "GPU busy fraction from NVML (0..1)", registry=r)
                                if gpu else None)
        # ---- Kafka (asyncio loop) --------------------------------------------------------
        self.consumer_lag = Gauge(
            "kafka_consumer_lag", "Log end offset minus this group's committed offset, per assigned job partition",
            ("topic", "partition"), registry=r)
        self.assigned_partitions = Gauge("kafka_assigned_partitions", "Job partitions assigned to this worker",
                                         registry=r)
        self.paused_partitions = Gauge("kafka_paused_partitions", "Job partitions paused by backpressure",
                                       registry=r)
        self.dlq_records = Counter("dlq_records", "Invalid job records sent to the DLQ topic", registry=r)
        self.commit_failures = Counter("kafka_commit_failures", "Offset commits that failed", registry=r)
        self.rebalances = Counter("kafka_rebalances", "Partition revocations seen by this worker", registry=r)
        self.consumer_restarts = Counter("kafka_consumer_restarts", "Consumers recreated by the stall watchdog",
                                         registry=r)
        self.cancels = Counter("cancels_received", "Valid cancel messages read", registry=r)
        # ---- the I/O path (asyncio loop) -------------------------------------------------
        self.events_published = Counter("events_published", "Events sent to Redis (token events may merge "
                                        "several steps' tokens when the publisher is behind)", registry=r)
        self.publish_round = Histogram("publish_round_duration_seconds",
                                       "Time to write one publisher round (all drafted events) to Redis",
                                       buckets=STEP_BUCKETS, registry=r)
        self.redis_outage = Gauge("redis_outage", "1 while Redis is unreachable and events are held", registry=r)
        self.publish_backlog = Gauge("publish_backlog_jobs", "Jobs with events waiting for the next publisher "
                                     "round (a lasting value above 0 means the I/O side is the bottleneck and "
                                     "token events are being merged)", registry=r)
        self.redis_restores = Counter("redis_restores", "Times Redis was found to have lost its data and the "
                                      "held jobs' logs were restored", registry=r)
        self.loop_lag = Histogram("event_loop_lag_seconds", "How late the asyncio loop wakes a 100 ms sleep "
                                  "(a starved loop misses Kafka heartbeats)", buckets=LAG_BUCKETS, registry=r)

        self._window_s = throughput_window_s
        self._tok_window: deque[tuple[int, int, int]] = deque()  # (second, prefill, decode)

    # ---- engine thread ---------------------------------------------------------------------
    def observe_step(self, s: StepStats) -> None:
        """Record one engine step (called on the engine thread after every `step`)."""
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self._set_kv(s.kv)
        if s.num_preemptions:
            self.preemptions.inc(s.num_preemptions)
        if s.num_oom_retried:
            self.oom.labels("retried").inc(s.num_oom_retried)
        if s.num_oom_failed:
            self.oom.labels("failed").inc(s.num_oom_failed)
            self.request_errors.labels("oom").inc(s.num_oom_failed)
        if s.num_internal_errors:
            self.request_errors.labels("internal").inc(s.num_internal_errors)
        if s.num_failed_forwards:
            self.failed_forwards.inc(s.num_failed_forwards)
        self.step_duration.observe(s.duration_s)
        self.step_host.observe(max(0.0, s.duration_s - s.forward_s))
        self._add_tokens(s.time, s.num_prefill_tokens, s.num_decode_tokens)

    def observe_idle(self, kv: KVStats, running: int, waiting: int, now: float | None = None) -> None:
        """Refresh gauges while the engine has nothing to do (engine thread)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self._set_kv(kv)
        self._add_tokens(time.time() if now is None else now, 0, 0)

    def _set_kv(self, kv: KVStats) -> None:
        self.kv_usage.set(kv.usage_ratio)
        self.kv_blocks.set(kv.total_blocks)

    def _add_tokens(self, now: float, prefill: int, decode: int) -> None:
        sec = int(now)
        w = self._tok_window
        if w and w[-1][0] == sec:
            _, p, d = w[-1]
            w[-1] = (sec, p + prefill, d + decode)
        else:
            w.append((sec, prefill, decode))
        horizon = sec - math.ceil(self._window_s)
        while w and w[0][0] <= horizon:
            w.popleft()
        self.prefill_tps.set(sum(x[1] for x in w) / self._window_s)
        self.decode_tps.set(sum(x[2] for x in w) / self._window_s)

    # ---- names -----------------------------------------------------------------------------
    def names(self) -> set[str]:
        """Every exported sample name (histograms: `_bucket`, `_sum`, `_count`; counters:
        `_total`), as PromQL would use them."""
        out = set()
        for metric in self.registry.collect():
            for sample in metric.samples:
                out.add(sample.name)
            if metric.type == "counter":
                out.add(metric.name + "_total")
            elif metric.type == "histogram":
                out.update(metric.name + sfx for sfx in ("_bucket", "_sum", "_count"))
            else:
                out.add(metric.name)
        return out
