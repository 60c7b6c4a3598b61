"""The LoRA adapters' series of one worker (issue 30), part of `Metrics` (`metrics.lora`).

`adapter` labels only `lora_requests_total`, bounded like `tenant` (TenantLabels: the
top `metrics.tenant_labels` adapters by requests, the rest summed as `other`).
Writers: `observe` on the engine thread after a step; `request` on the asyncio loop.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from worker.engine.outputs import LoRAStepStats

LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LoRAMetrics:
    def __init__(self, registry: CollectorRegistry, labels) -> None:
        r = registry
        self.resident = Gauge("lora_adapters_resident", "LoRA adapters loaded in a device slot (model.max_loras "
                              "slots)", registry=r)
        self.active = Gauge("lora_adapters_active", "Distinct LoRA adapters of the running batch "
                            "(serving_tuning.max_loras_per_batch)", registry=r)
        self.loads = Counter("lora_loads", "LoRA adapter loads (disk to host memory, on the loader thread)",
                             registry=r)
        self.evictions = Counter("lora_evictions", "Resident LoRA adapters evicted (least recently used) for "
                                 "another's load", registry=r)
        self.load_failures = Counter("lora_load_failures", "LoRA adapter loads that raised (their waiting jobs "
                                     "ended with error adapter_load_failed)", registry=r)
        self.load_time = Histogram("lora_load_seconds", "Time to load one LoRA adapter", buckets=LOAD_BUCKETS,
                                   registry=r)
        self.requests = Counter("lora_requests", "Jobs handed to the engine per LoRA adapter (top N adapters by "
                                "requests, the rest as `other`)", ("adapter",), registry=r)
        self.labels = labels  # a TenantLabels over adapter names

    def observe(self, s: LoRAStepStats) -> None:
        self.resident.set(s.resident)
        self.active.set(s.active)
        if s.loads:
            self.loads.inc(s.loads)
        if s.evictions:
            self.evictions.inc(s.evictions)
        if s.failures:
            self.load_failures.inc(s.failures)
        for t in s.load_s:
            self.load_time.observe(t)

    def request(self, adapter: str) -> None:
        self.labels.count(adapter, 1)
        self.requests.labels(self.labels.label(adapter)).inc()

    def evict(self, adapter: str) -> None:
        with contextlib.suppress(KeyError):
            self.requests.remove(adapter)
