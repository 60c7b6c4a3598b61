"""Every Prometheus series of one worker, defined here and nowhere else.

Base units (seconds, tokens, ratios 0..1); labels are low-cardinality only: `priority`
(high/normal/low), `finish_reason`, `reason`, `outcome`, `code` (an engine ErrorCode), the
Kafka `topic` / `partition` of the job topics (bounded by the partition count), and
`tenant` on the per-tenant series, bounded by TenantLabels (the top
`metrics.tenant_labels` tenants by tokens served, the rest summed as `other`). Never a
job id.

One `Metrics` object per worker process, in its own `CollectorRegistry`, served on the
worker's `/metrics`. Several worker processes on one host each serve their own port
(`metrics.port`), and Prometheus tells them apart by target (`instance`/`pod` labels);
no multiprocess aggregation is done or needed, since one process owns one engine.

Writers: `observe_step` / `observe_idle` run on the engine thread after each step
(cost: 0.014–0.04 ms per step on the 2-core CPU box, `tools/bench/engine.py scheduler`);
everything else runs on the worker's asyncio loop. prometheus-client is thread-safe.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.openmetrics import exposition as openmetrics

from schemas.wire import FINISH_REASONS
from worker.obs.kv_host_metrics import HostKVMetrics
from worker.obs.lora_metrics import LoRAMetrics
from worker.obs.quota_metrics import QuotaMetrics
from worker.obs.spec_metrics import SpecMetrics

if TYPE_CHECKING:
    from worker.engine import KVStats, StepStats


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """(body, Content-Type) of a `/metrics` scrape: the OpenMetrics text format when the
    scraper asks for it (`Accept: application/openmetrics-text`, as Prometheus does with
    exemplar storage on), which carries the latency histograms' exemplars (the trace id
    of a traced job); else Prometheus' text format 0.0.4 (no exemplars)."""
    if accept and "application/openmetrics-text" in accept:
        return openmetrics.generate_latest(registry), openmetrics.CONTENT_TYPE_LATEST
    return generate_latest(registry), CONTENT_TYPE_LATEST

# Bucket upper bounds, seconds. TTFT 1 ms–120 s, TPOT 1 ms–2 s, e2e 10 ms–600 s.
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
MASK_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

PRIORITY = ("priority",)
# Label values exported at 0 from the start, so a dashboard reads 0 rather than "no data"
# before the first event (tests/unit/test_metrics.py checks them against their enums).
PRIORITIES = ("high", "normal", "low")
ABORT_REASONS = ("cancelled", "handed_back", "lease_lost")
REJECT_REASONS = ("empty_prompt", "prompt_too_long", "exceeds_context", "exceeds_kv_capacity", "invalid_params",
                  "invalid_prompt", "invalid_structured_output", "duplicate_request_id", "overloaded",
                  "unknown_adapter", "invalid_adapter", "invalid_job")
OOM_OUTCOMES = ("retried", "failed")
ERROR_CODES = ("internal", "oom")
OTHER_TENANTS = "other"  # the label of every tenant outside the top N
NO_TENANT = "none"  # the label of jobs without a tenant
MAX_RANKED_TENANTS = 10_000  # distinct tenants counted per ranking window (later ones rank as 0)


class TenantLabels:
    """Bounded `tenant` label values: at most `n` tenants keep their own label, the rest
    are `other`. Until `n` are labelled a new tenant gets its own at once; every
    `interval_s` the labelled set becomes the top `n` by tokens served in the window
    just ended (ties by name), and `on_evict` is called for each tenant that left it so
    its series can be removed (its later traffic counts in `other`). So each per-tenant
    metric has at most n + 1 tenant values at any time. Thread-safe enough for its use:
    called from the asyncio loop only.
    """

    def __init__(self, n: int, interval_s: float, on_evict, clock=time.monotonic) -> None:
        self.n = n
        self.interval_s = interval_s
        self._on_evict = on_evict
        self._clock = clock
        self._labelled: set[str] = set()
        self._window: dict[str, int] = {}
        self._window_start = clock()

    def label(self, tenant: str | None) -> str:
        """The label value for `tenant` now (re-ranks first if the window has ended)."""
        name = tenant or NO_TENANT
        self._maybe_rerank()
        if name in self._labelled:
            return name
        if len(self._labelled) < self.n and name != OTHER_TENANTS:
            self._labelled.add(name)
            return name
        return OTHER_TENANTS

    def count(self, tenant: str | None, tokens: int) -> None:
        """Add `tokens` served to `tenant`'s traffic in the current window."""
        name = tenant or NO_TENANT
        if name in self._window or len(self._window) < MAX_RANKED_TENANTS:
            self._window[name] = self._window.get(name, 0) + tokens

    def _maybe_rerank(self) -> None:
        now = self._clock()
        if now - self._window_start < self.interval_s:
            return
        ranked = sorted(self._window.items(), key=lambda kv: (-kv[1], kv[0]))
        top = {name for name, tokens in ranked[: self.n] if tokens > 0 and name != OTHER_TENANTS}
        for name in sorted(self._labelled - top):
            self._on_evict(name)
        self._labelled = top
        self._window = {}
        self._window_start = now


class Metrics:
    """The worker's metrics. Args:
    registry: where to register (a fresh `CollectorRegistry` if None, so several
        workers in one test process do not collide).
    throughput_window_s: window of the `*_tokens_per_second` gauges, seconds.
    gpu: also export `gpu_utilization` (set True when NVML is present on a CUDA box).
    tenant_labels, tenant_rank_interval_s: the bound of the `tenant` label (TenantLabels).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, throughput_window_s: float = 10.0,
                 gpu: bool = False, tenant_labels: int = 10, tenant_rank_interval_s: float = 60.0,
                 clock=time.monotonic) -> None:
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
        self.forwarded = Counter(
            "jobs_forwarded", "Jobs sent on to the pool that serves their prompt length (schemas/pools.py)",
            ("pool", "to_pool"), registry=r)
        self.pool_info = Gauge("worker_pool_info", "1, labelled with the pool this worker serves", ("pool",),
                               registry=r)
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens of finished requests (each counted once)", registry=r)
        # vLLM's names: the fleet's hit rate is sum(rate(hits)) / sum(rate(queries))
        self.prefix_cache_queries = Counter(
            "prefix_cache_queries", "Prompt tokens of finished requests looked up in the prefix cache (each "
            "request once, at its first admission)", registry=r)
        self.prefix_cache_hits = Counter(
            "prefix_cache_hits", "Of those, tokens the prefix cache served (device or host tier)", registry=r)
        self.generation_tokens = Counter(
            "generation_tokens", "Output tokens delivered to the publisher (never counted twice after preemption)",
            registry=r)
        self.cancel_to_free = Histogram(
            "cancel_to_free_seconds", "Cancel message received to the job's KV blocks freed by the engine",
            buckets=CANCEL_BUCKETS, registry=r)
        self.local_jobs = Gauge("local_jobs", "Jobs held by this worker (in the engine or about to enter it)",
                                registry=r)
        # ---- per tenant (asyncio loop); `tenant` bounded by TenantLabels ----------------
        self.tenant_tokens = Counter(
            "tenant_tokens", "Tokens served per tenant: prompt tokens of jobs that ran (at their end), output "
            "tokens as delivered; tenants outside the top N by traffic are summed as `other`",
            ("tenant", "kind"), registry=r)
        self.tenant_queue_time = Histogram(
            "tenant_queue_time_seconds", "Enqueue (Kafka record timestamp) to first scheduled in the engine, per "
            "tenant (top N by traffic, the rest as `other`)", ("tenant",), buckets=QUEUE_BUCKETS, registry=r)
        self.tenants = TenantLabels(tenant_labels, tenant_rank_interval_s, self._evict_tenant, clock=clock)
        self.lora = LoRAMetrics(r, TenantLabels(tenant_labels, tenant_rank_interval_s, lambda a: self.lora.evict(a),
                                                clock=clock))  # LoRA adapters (lora_metrics.py)
        self.spec = SpecMetrics(r)  # speculative decoding (spec_metrics.py)
        self.kv_host = HostKVMetrics(r)  # the host-memory KV tier (kv_host_metrics.py)
        self.quota = QuotaMetrics(r)  # tenant admission denials, fleet limits' fallback (quota_metrics.py)
        # ---- per step (engine thread) ----------------------------------------------------
        self.running = Gauge("running_requests", "Requests in the running batch", registry=r)
        self.waiting = Gauge("waiting_requests", "Requests waiting for admission (incl. preempted)", registry=r)
        self.kv_usage = Gauge("kv_cache_usage_ratio", "Used KV blocks / total KV blocks (0..1)", registry=r)
        self.kv_blocks = Gauge("kv_cache_blocks", "Total KV blocks of the paged cache", registry=r)
        self.prefill_tps = Gauge("prefill_tokens_per_second", "Prefill tokens computed per second (recent window)",
                                 registry=r)
        self.decode_tps = Gauge("decode_tokens_per_second", "Decode tokens computed per second (recent window)",
                                registry=r)
        self.device_busy = Gauge("engine_device_busy_ratio", "Fraction of wall time the engine's device was busy "
                                 "over the recent window (0..1; CUDA events, the CPU forward, or an emulated "
                                 "device's queue): what overlap of host work and forward leaves idle", registry=r)
        self.preemptions = Counter("preemptions", "Requests preempted by recompute (KV blocks ran out)", registry=r)
        self.long_prefill_capped = Counter(
            "long_prefill_capped", "Long prompts' prefill chunks cut (or deferred) by the per-step cap "
            "serving_tuning.max_long_prefill_tokens", registry=r)
        self.long_prefill_tokens = Counter(
            "long_prefill_tokens", "Prefill tokens computed for long prompts (serving_tuning.long_prefill_threshold)",
            registry=r)
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
        # ---- structured outputs (engine thread) ------------------------------------------------
        self.structured_requests = Gauge("structured_output_requests", "Requests with a structured-output "
                                         "constraint in the engine (running, waiting, or waiting for their grammar)",
                                         registry=r)
        self.grammar_compile = Histogram("structured_output_compile_seconds", "Time to compile one grammar "
                                         "(on the engine's grammar thread, never on the step path)",
                                         buckets=STEP_BUCKETS, registry=r)
        self.grammar_mask = Histogram("structured_output_mask_seconds", "Time of one step spent computing and "
                                      "applying the allowed-token masks (steps with constrained rows only)",
                                      buckets=MASK_BUCKETS, registry=r)
        self.grammar_cache = Counter("structured_output_grammar_cache", "Compiled-grammar cache lookups of "
                                     "constrained requests, by result", ["result"], registry=r)
        for result in ("hit", "miss"):
            self.grammar_cache.labels(result)
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
        self.dlq_records = Counter("dlq_records", "Job records sent to the DLQ topic, by reason (the record's "
                                   "inflight.reason: a rejection's code such as prompt_too_long, a client's "
                                   "mistake; invalid_job or poison, records no worker can process)", ("reason",),
                                   registry=r)
        self.commit_failures = Counter("kafka_commit_failures", "Offset commits that failed", registry=r)
        self.kafka_errors = Counter("kafka_errors", "Transient Kafka errors a part of the worker met and retried, by "
                                    "part and error class (KafkaTimeoutError on results: a write unacknowledged "
                                    "for 30 s, no leader or too few in-sync replicas; it waits, its offset open)",
                                    ("part", "error"), registry=r)
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
        self.kafka_outage = Gauge("kafka_outage", "1 while a part of the worker cannot reach Kafka (retrying; held "
                                  "jobs keep streaming, outcomes and commits wait)", registry=r)
        self.publish_backlog = Gauge("publish_backlog_jobs", "Jobs with events waiting for the next publisher "
                                     "round (a lasting value above 0 means the I/O side is the bottleneck and "
                                     "token events are being merged)", registry=r)
        self.redis_restores = Counter("redis_restores", "Times Redis was found to have lost its data and the "
                                      "held jobs' logs were restored", registry=r)
        self.loop_lag = Histogram("event_loop_lag_seconds", "How late the asyncio loop wakes a 100 ms sleep "
                                  "(a starved loop misses Kafka heartbeats)", buckets=LAG_BUCKETS, registry=r)

        for counter, values in ((self.finished, FINISH_REASONS), (self.aborted, ABORT_REASONS),
                                (self.rejected, REJECT_REASONS), (self.oom, OOM_OUTCOMES),
                                (self.request_errors, ERROR_CODES)):
            for v in values:
                counter.labels(v)
        for h in (self.queue_time, self.ttft, self.tpot, self.e2e):
            for prio in PRIORITIES:
                h.labels(prio)

        self._window_s = throughput_window_s
        self._tok_window: deque[tuple[int, int, int]] = deque()  # (second, prefill, decode)
        self._busy_window: deque[tuple[float, float]] = deque()  # (monotonic s, cumulative device busy s)

    # ---- per tenant (asyncio loop) ----------------------------------------------------------
    def observe_tenant_tokens(self, tenant: str | None, kind: str, tokens: int) -> None:
        """`tokens` served to `tenant`; `kind` is `prompt` or `generation`."""
        if tokens <= 0:
            return
        self.tenants.count(tenant, tokens)
        self.tenant_tokens.labels(self.tenants.label(tenant), kind).inc(tokens)

    def observe_tenant_queue_time(self, tenant: str | None, seconds: float) -> None:
        self.tenant_queue_time.labels(self.tenants.label(tenant)).observe(seconds)

    def _evict_tenant(self, name: str) -> None:
        for kind in ("prompt", "generation"):
            with contextlib.suppress(KeyError):  # never observed with this kind
                self.tenant_tokens.remove(name, kind)
        with contextlib.suppress(KeyError):
            self.tenant_queue_time.remove(name)

    # ---- engine thread ---------------------------------------------------------------------
    def observe_step(self, s: StepStats) -> None:
        """Record one engine step (called on the engine thread after every `step`)."""
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self._set_kv(s.kv)
        if s.num_preemptions:
            self.preemptions.inc(s.num_preemptions)
        if s.num_long_prefill_capped:
            self.long_prefill_capped.inc(s.num_long_prefill_capped)
        if s.num_long_prefill_tokens:
            self.long_prefill_tokens.inc(s.num_long_prefill_tokens)
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
        self._add_busy(time.monotonic(), s.device_busy_s)
        self.structured_requests.set(s.num_constrained)
        if s.lora is not None:
            self.lora.observe(s.lora)
        if s.spec is not None:
            self.spec.observe(s.spec)
        if s.host_kv is not None:
            self.kv_host.observe(s.host_kv, s.kv)
        if s.mask_s:
            self.grammar_mask.observe(s.mask_s)
        for c in s.grammar_compile_s:
            self.grammar_compile.observe(c)
        if s.grammar_cache_hits:
            self.grammar_cache.labels("hit").inc(s.grammar_cache_hits)
        if s.grammar_cache_misses:
            self.grammar_cache.labels("miss").inc(s.grammar_cache_misses)

    def observe_idle(self, kv: KVStats, running: int, waiting: int, now: float | None = None) -> None:
        """Refresh gauges while the engine has nothing to do (engine thread)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self._set_kv(kv)
        self._add_tokens(time.time() if now is None else now, 0, 0)
        if self._busy_window:  # idle: the device's busy time stands still
            self._add_busy(time.monotonic(), self._busy_window[-1][1])

    def _add_busy(self, now: float, busy_s: float) -> None:
        """engine_device_busy_ratio = device busy seconds / wall seconds over the last
        `throughput_window_s` (`busy_s` is the runner's cumulative busy time)."""
        w = self._busy_window
        w.append((now, busy_s))
        while len(w) > 2 and now - w[1][0] >= self._window_s:
            w.popleft()
        t0, b0 = w[0]
        if now > t0:
            self.device_busy.set(min(1.0, max(0.0, (busy_s - b0) / (now - t0))))

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
