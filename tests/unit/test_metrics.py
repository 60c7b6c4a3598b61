"""Metric definitions: names, buckets, throughput window, histogram quantiles."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from worker.engine import KVStats, StepStats
from worker.obs.metrics import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, Metrics

DESIGN_NAMES = [
    "request_queue_time_seconds_bucket", "llm_ttft_seconds_bucket", "llm_tpot_seconds_bucket",
    "llm_e2e_request_latency_seconds_bucket", "running_requests", "waiting_requests",
    "kv_cache_usage_ratio", "prefill_tokens_per_second", "decode_tokens_per_second",
    "request_abort_total", "request_oom_total", "request_rejected_total", "preemptions_total",
    "request_finished_total",
]


def test_design_metric_names_are_exported():
    names = Metrics().names()
    missing = [n for n in DESIGN_NAMES if n not in names]
    assert not missing
    assert "gpu_utilization" not in names  # only with NVML on a CUDA box
    assert "gpu_utilization" in Metrics(gpu=True).names()


def test_bucket_ranges_follow_the_design():
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 120.0
    assert TPOT_BUCKETS[0] == 0.001 and TPOT_BUCKETS[-1] == 2.0
    assert E2E_BUCKETS[0] == 0.01 and E2E_BUCKETS[-1] == 600.0
    for b in (TTFT_BUCKETS, TPOT_BUCKETS, E2E_BUCKETS):
        assert list(b) == sorted(set(b))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket that holds
    the q-th observation. `buckets` are (upper bound, cumulative count), +Inf last."""
    total = buckets[-1][1]
    rank = q * total
    lower, prev = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - prev) / (count - prev)
        lower, prev = upper, count
    return lower


def scraped_buckets(m: Metrics, family: str, **labels) -> list[tuple[float, float]]:
    out = []
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        if fam.name != family:
            continue
        for s in fam.samples:
            if s.name == family + "_bucket" and all(s.labels.get(k) == v for k, v in labels.items()):
                out.append((float(s.labels["le"]), s.value))
    return sorted(out)


def test_quantiles_of_known_samples_land_in_the_right_buckets():
    m = Metrics()
    # 90 fast first tokens at 30 ms, 9 at 300 ms, 1 at 30 s
    for v in [0.03] * 90 + [0.3] * 9 + [30.0]:
        m.ttft.labels("high").observe(v)
    b = scraped_buckets(m, "llm_ttft_seconds", priority="high")
    assert b[-1] == (math.inf, 100)
    p50, p95, p99 = (histogram_quantile(q, b) for q in (0.5, 0.95, 0.99))
    assert 0.02 < p50 <= 0.04  # the (20 ms, 40 ms] bucket holds 30 ms
    assert 0.25 < p95 <= 0.5
    assert 0.25 < p99 <= 0.5  # the 99th of 100 is the last 300 ms sample
    assert histogram_quantile(0.999, b) > 20.0  # the 30 s outlier: (20, 40] bucket
    assert m.registry.get_sample_value("llm_ttft_seconds_count", {"priority": "high"}) == 100
    assert m.registry.get_sample_value("llm_ttft_seconds_sum", {"priority": "high"}) == pytest.approx(
        90 * 0.03 + 9 * 0.3 + 30.0)


def stats(t: float, prefill: int, decode: int, used: int = 0) -> StepStats:
    kv = KVStats(total_blocks=10, used_blocks=used, free_blocks=10 - used, cached_blocks=0, block_size=16)
    return StepStats(step=1, time=t, duration_s=0.001, num_running=1, num_waiting=0, num_prefill_tokens=prefill,
                     num_decode_tokens=decode, num_preemptions=0, num_oom_retried=0, num_oom_failed=0, kv=kv)


def test_throughput_gauges_use_a_sliding_window():
    m = Metrics(throughput_window_s=10.0)
    t0 = 1_000_000.0
    for i in range(100):  # 10 s of steps: 100 prefill and 50 decode tokens per 0.1 s
        m.observe_step(stats(t0 + i * 0.1, 100, 50, used=3))
    assert m.registry.get_sample_value("prefill_tokens_per_second") == pytest.approx(1000, rel=0.11)
    assert m.registry.get_sample_value("decode_tokens_per_second") == pytest.approx(500, rel=0.11)
    assert m.registry.get_sample_value("kv_cache_usage_ratio") == pytest.approx(0.3)
    kv = KVStats(total_blocks=10, used_blocks=0, free_blocks=10, cached_blocks=0, block_size=16)
    m.observe_idle(kv, 0, 0, now=t0 + 25)  # idle for longer than the window: rates fall to zero
    assert m.registry.get_sample_value("prefill_tokens_per_second") == 0
    assert m.registry.get_sample_value("decode_tokens_per_second") == 0
    assert m.registry.get_sample_value("kv_cache_usage_ratio") == 0


def test_two_workers_in_one_process_do_not_share_series():
    a, b = Metrics(), Metrics()
    a.finished.labels("stop").inc()
    assert a.registry.get_sample_value("request_finished_total", {"finish_reason": "stop"}) == 1
    assert b.registry.get_sample_value("request_finished_total", {"finish_reason": "stop"}) == 0  # its own, at 0


def tenant_series(m: Metrics) -> dict[str, set[str]]:
    """{family: set of tenant label values} of the per-tenant series as scraped."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        if fam.name.endswith("_created"):
            continue
        for s in fam.samples:
            if "tenant" in s.labels:
                out.setdefault(fam.name, set()).add(s.labels["tenant"])
    return out


def test_tenant_labels_are_bounded_to_the_top_n_by_tokens_plus_other():
    now = [0.0]
    m = Metrics(tenant_labels=2, tenant_rank_interval_s=60.0, clock=lambda: now[0])
    for tenant, tokens in (("a", 10), ("b", 20), ("c", 500), (None, 5)):
        m.observe_tenant_tokens(tenant, "generation", tokens)
        m.observe_tenant_queue_time(tenant, 0.1)
    # the first two tenants seen hold the labels until the first re-rank
    assert tenant_series(m) == {"tenant_tokens": {"a", "b", "other"}, "tenant_queue_time_seconds": {"a", "b", "other"}}
    now[0] = 61.0
    m.observe_tenant_tokens("c", "prompt", 1)  # re-rank: c (500) and b (20) are the top two
    series = tenant_series(m)
    assert series["tenant_tokens"] == {"b", "c", "other"}  # a's series removed, not left to grow
    assert series["tenant_queue_time_seconds"] <= {"b", "c", "other"}
    totals = {s.labels["tenant"]: s.value for fam in text_string_to_metric_families(generate_latest(m.registry).decode())
              if fam.name == "tenant_tokens" for s in fam.samples
              if s.name == "tenant_tokens_total" and s.labels["kind"] == "generation"}
    assert totals == {"b": 20.0, "other": 505.0}  # c and `none` were counted in `other` before
    for i in range(50):  # many more tenants: still at most n + 1 label values
        m.observe_tenant_tokens(f"t{i}", "generation", 1)
    assert len(tenant_series(m)["tenant_tokens"]) <= 3


def test_labelled_counters_read_zero_before_their_first_event():
    # issue 32: a panel read "no data" until the first OOM / error / rejection
    from schemas.wire import FINISH_REASONS
    from worker.engine.request import ErrorCode, RejectReason
    from worker.obs import metrics as mod

    assert set(mod.REJECT_REASONS) == {r.value for r in RejectReason} | {"invalid_job"}
    assert set(mod.ERROR_CODES) <= {c.value for c in ErrorCode}
    m = Metrics()
    get = m.registry.get_sample_value
    for reason in FINISH_REASONS:
        assert get("request_finished_total", {"finish_reason": reason}) == 0.0
    for reason in mod.REJECT_REASONS:
        assert get("request_rejected_total", {"reason": reason}) == 0.0
    for name, label, values in (("request_abort_total", "reason", mod.ABORT_REASONS),
                                ("request_oom_total", "outcome", mod.OOM_OUTCOMES),
                                ("request_errors_total", "code", mod.ERROR_CODES)):
        assert all(get(name, {label: v}) == 0.0 for v in values), name
    assert all(get("llm_ttft_seconds_count", {"priority": p}) == 0.0 for p in ("high", "normal", "low"))


def test_speculative_decoding_counters_follow_the_steps():
    from msgspec.structs import replace

    from worker.engine.outputs import SpecStepStats

    m = Metrics()
    m.observe_step(replace(stats(1.0, 0, 8), spec=SpecStepStats(2, 6, 4, [2, 1, 1])))
    m.observe_step(replace(stats(1.1, 0, 4), spec=SpecStepStats(1, 3, 1, [1, 0, 0])))
    m.observe_step(stats(1.2, 0, 1))  # speculation off: nothing
    get = m.registry.get_sample_value
    assert (get("spec_decode_num_drafts_total"), get("spec_decode_num_draft_tokens_total"),
            get("spec_decode_num_accepted_tokens_total")) == (3, 9, 5)
    assert [get("spec_decode_num_accepted_tokens_per_pos_total", {"position": p}) for p in "012"] == [3, 1, 1]
