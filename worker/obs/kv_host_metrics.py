"""The host-memory KV tier's series of one worker (`serving_tuning.host_kv_bytes`), part
of `Metrics` (`metrics.kv_host`). Host hits are `kv_host_blocks_total{direction="load"}`
(each load restores one block of a prefix hit instead of recomputing it); the share of
prefix tokens the tier served is that times the block size over the prompt tokens.
Writer: `observe` on the engine thread after a step; the series stay at zero without a tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from worker.engine.outputs import HostKVStepStats, KVStats

COPY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class HostKVMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.blocks = Counter("kv_host_blocks", "KV blocks copied between the device cache and the host tier "
                              "(save: evicted from the device's prefix cache; load: a prefix hit restored)",
                              ("direction",), registry=r)
        self.bytes = Counter("kv_host_bytes", "Bytes copied between the device cache and the host tier",
                             ("direction",), registry=r)
        self.copy = Histogram("kv_host_copy_seconds", "Seconds a step spent on its host-tier copies, before its "
                              "forward (on CUDA: queuing them)", buckets=COPY_BUCKETS, registry=r)
        self.usage = Gauge("kv_host_usage_ratio", "Host-tier slots holding a block / all its slots (0..1)",
                           registry=r)
        self.capacity = Gauge("kv_host_blocks_capacity", "Blocks the host tier holds", registry=r)

    def observe(self, s: HostKVStepStats, kv: KVStats) -> None:
        self.capacity.set(kv.host_blocks)
        self.usage.set(kv.host_used_blocks / kv.host_blocks if kv.host_blocks else 0.0)
        if s.saved_blocks:
            self.blocks.labels("save").inc(s.saved_blocks)
            self.bytes.labels("save").inc(s.saved_bytes)
        if s.loaded_blocks:
            self.blocks.labels("load").inc(s.loaded_blocks)
            self.bytes.labels("load").inc(s.loaded_bytes)
        if s.saved_blocks or s.loaded_blocks:
            self.copy.observe(s.copy_s)
