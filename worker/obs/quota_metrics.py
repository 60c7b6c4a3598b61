"""The tenant admission series of one worker, part of `Metrics` (`metrics.quota`): how
often the intake passed a tenant's waiting records over, and why (its local cap of jobs
held, or a fleet-wide limit: `worker/serve/fleet_quota.py`), and whether the fleet
limits run on this worker's share because Redis is unreachable.
Writer: the worker's asyncio thread.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class QuotaMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.denials = Counter(
            "tenant_admission_denials", "Admission rounds of the intake that passed a tenant with records waiting "
            "over, by reason: tenant_cap (its local jobs at worker.max_local_jobs_per_tenant or twice its "
            "running quota), fleet_tokens (its fleet token bucket empty), fleet_running (its fleet-wide jobs "
            "held at fleet_max_running)", ("reason",), registry=r)
        self.fallback = Gauge(
            "fleet_quota_fallback", "1 while the fleet-wide tenant limits run on this worker's share "
            "(limit / live workers) because Redis is unreachable, else 0", registry=r)
