"""Write the Grafana dashboard of Inflight workers (deploy/grafana/dashboards/inflight.json).

The dashboard is generated so its queries stay in one readable list; run this after
changing a panel and commit the JSON (tests check every metric it queries is one the
worker exports):

    python -m tools.make_dashboard
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "inflight.json"


def q(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend, "datasource": {"type": "prometheus", "uid": "prometheus"}}


def quantiles(metric: str, by: str = "") -> list[dict]:
    grp = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [q(f"histogram_quantile({p}, sum by ({grp}) (rate({metric}_bucket[$__rate_interval])))", f"p{int(p * 100)}{suffix}")
            for p in (0.5, 0.95, 0.99)]


# (row title, [(panel title, unit, targets)])
ROWS = [
    ("Latency", [
        ("Time to first token (TTFT)", "s", quantiles("llm_ttft_seconds")),
        ("Time per output token (TPOT)", "s", quantiles("llm_tpot_seconds")),
        ("End-to-end latency", "s", quantiles("llm_e2e_request_latency_seconds")),
        ("Queue time (enqueue to first scheduled)", "s", quantiles("request_queue_time_seconds")),
        ("TTFT p99 by priority", "s", [q("histogram_quantile(0.99, sum by (le, priority) "
                                          "(rate(llm_ttft_seconds_bucket[$__rate_interval])))", "{{priority}}")]),
        ("Cancel to KV freed", "s", quantiles("cancel_to_free_seconds")),
    ]),
    ("Throughput and batch", [
        ("Tokens per second", "short", [q("sum(prefill_tokens_per_second)", "prefill"),
                                        q("sum(decode_tokens_per_second)", "decode"),
                                        q("sum(rate(generation_tokens_total[$__rate_interval]))", "delivered")]),
        ("Running and waiting requests", "short", [q("sum by (instance) (running_requests)", "running {{instance}}"),
                                                   q("sum by (instance) (waiting_requests)", "waiting {{instance}}"),
                                                   q("sum by (instance) (local_jobs)", "held {{instance}}")]),
        ("KV cache usage", "percentunit", [q("kv_cache_usage_ratio", "{{instance}}")]),
        ("GPU utilization", "percentunit", [q("gpu_utilization", "{{instance}}")]),
        ("Engine step duration", "s", quantiles("engine_step_duration_seconds")),
        ("Preemptions per second", "short", [q("sum(rate(preemptions_total[$__rate_interval]))", "preemptions")]),
    ]),
    ("Pools by prompt length (each worker's pool: worker_pool_info)", [
        ("Consumer lag by pool", "short", [q("sum by (pool) (kafka_consumer_lag * on (instance) group_left (pool) "
                                             "worker_pool_info)", "{{pool}}")]),
        ("Finished jobs by pool", "reqps", [q("sum by (pool) (rate(request_finished_total[$__rate_interval]) "
                                              "* on (instance) group_left (pool) worker_pool_info)", "{{pool}}")]),
        ("Jobs forwarded between pools", "reqps", [q("sum by (pool, to_pool) (rate(jobs_forwarded_total"
                                                     "[$__rate_interval]))", "{{pool}} -> {{to_pool}}")]),
        ("Long-prompt prefill (tiering)", "short", [
            q("sum(rate(long_prefill_tokens_total[$__rate_interval]))", "long prefill tokens/s"),
            q("sum(rate(long_prefill_capped_total[$__rate_interval]))", "chunks capped/s")]),
        ("Live workers by pool (the gateways' count; at 0 they answer 503)", "short", [
            q("max by (pool) (gateway_live_workers)", "{{pool}}")]),
    ]),
    ("Tenants (top N by tokens served, the rest as `other`)", [
        ("Tokens served per tenant", "short", [q("sum by (tenant) (rate(tenant_tokens_total[$__rate_interval]))",
                                                 "{{tenant}}")]),
        ("Share of tokens per tenant", "percentunit", [
            q("sum by (tenant) (rate(tenant_tokens_total[$__rate_interval])) / scalar(sum(rate("
              "tenant_tokens_total[$__rate_interval])))", "{{tenant}}")]),
        ("Queue time p99 per tenant", "s", [q("histogram_quantile(0.99, sum by (le, tenant) "
                                              "(rate(tenant_queue_time_seconds_bucket[$__rate_interval])))",
                                              "{{tenant}}")]),
    ]),
    ("Tenant admission (local caps, fleet-wide limits through Redis)", [
        ("Admission rounds that passed a tenant over, by reason", "short", [
            q("sum by (reason) (rate(tenant_admission_denials_total[$__rate_interval]))", "{{reason}}")]),
        ("Workers on their local share (Redis unreachable)", "short", [
            q("sum(fleet_quota_fallback)", "workers falling back")]),
    ]),
    ("LoRA adapters (model.lora_dir)", [
        ("Adapters resident and in the batch", "short", [q("lora_adapters_resident", "resident {{instance}}"),
                                                         q("lora_adapters_active", "in the batch {{instance}}")]),
        ("Loads and evictions per second", "short", [
            q("sum(rate(lora_loads_total[$__rate_interval]))", "loads"),
            q("sum(rate(lora_evictions_total[$__rate_interval]))", "evictions"),
            q("sum(rate(lora_load_failures_total[$__rate_interval]))", "failed loads")]),
        ("Adapter load time", "s", quantiles("lora_load_seconds")),
        ("Jobs per adapter", "reqps", [q("sum by (adapter) (rate(lora_requests_total[$__rate_interval]))",
                                         "{{adapter}}")]),
    ]),
    ("Fleet cache (prefix affinity, host KV tier)", [
        ("Prefix-cache hit rate: fleet and per worker", "percentunit", [
            q("sum(rate(prefix_cache_hits_total[$__rate_interval])) / "
              "sum(rate(prefix_cache_queries_total[$__rate_interval]))", "fleet"),
            q("sum by (instance) (rate(prefix_cache_hits_total[$__rate_interval])) / "
              "sum by (instance) (rate(prefix_cache_queries_total[$__rate_interval]))", "{{instance}}")]),
        ("Host KV tier: blocks copied", "short", [
            q("sum by (direction) (rate(kv_host_blocks_total[$__rate_interval]))", "{{direction}}")]),
        ("Host KV tier: use and copy time", "short", [
            q("max by (instance) (kv_host_usage_ratio)", "use {{instance}}"),
            q("histogram_quantile(0.99, sum by (le) (rate(kv_host_copy_seconds_bucket[$__rate_interval])))",
              "copy p99 (s)")]),
    ]),
    ("Speculative decoding (serving_tuning.speculative)", [
        ("Acceptance rate", "percentunit", [
            q("sum(rate(spec_decode_num_accepted_tokens_total[$__rate_interval])) / "
              "sum(rate(spec_decode_num_draft_tokens_total[$__rate_interval]))", "accepted / proposed")]),
        ("Mean accepted length (tokens per speculating step)", "short", [
            q("1 + sum(rate(spec_decode_num_accepted_tokens_total[$__rate_interval])) / "
              "sum(rate(spec_decode_num_drafts_total[$__rate_interval]))", "tokens per draft")]),
        ("Accepted tokens by draft position", "short", [
            q("sum by (position) (rate(spec_decode_num_accepted_tokens_per_pos_total[$__rate_interval]))",
              "position {{position}}")]),
    ]),
    ("Outcomes", [
        ("Finished jobs by reason", "reqps", [q("sum by (finish_reason) (rate(request_finished_total[$__rate_interval]))",
                                                "{{finish_reason}}")]),
        ("Rejected by reason", "reqps", [q("sum by (reason) (rate(request_rejected_total[$__rate_interval]))",
                                           "{{reason}}")]),
        ("Aborted by reason", "reqps", [q("sum by (reason) (rate(request_abort_total[$__rate_interval]))",
                                          "{{reason}}")]),
        ("Out of memory", "short", [q("sum by (outcome) (increase(request_oom_total[$__rate_interval]))",
                                      "{{outcome}}")]),
    ]),
    ("Kafka", [
        ("Consumer lag by topic", "short", [q("sum by (topic) (kafka_consumer_lag)", "{{topic}}")]),
        ("Partitions", "short", [q("sum(kafka_assigned_partitions)", "assigned"),
                                 q("sum(kafka_paused_partitions)", "paused (backpressure)")]),
        ("DLQ records by reason", "short", [q("sum by (reason) (increase(dlq_records_total[$__rate_interval]))",
                                              "{{reason}}")]),
        ("Commit failures, rebalances, consumer restarts", "short", [
            q("sum(increase(kafka_commit_failures_total[$__rate_interval]))", "commit failures"),
            q("sum(increase(kafka_rebalances_total[$__rate_interval]))", "revocations"),
            q("sum(increase(kafka_consumer_restarts_total[$__rate_interval]))", "consumer restarts"),
            q("sum(rate(cancels_received_total[$__rate_interval]))", "cancels/s")]),
    ]),
]


def build() -> dict:
    panels, y, pid = [], 0, 1
    for row_title, row in ROWS:
        panels.append({"type": "row", "title": row_title, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid += 1
        y += 1
        for i, (title, unit, targets) in enumerate(row):
            panels.append({
                "type": "timeseries", "title": title, "id": pid,
                "datasource": {"type": "prometheus", "uid": "prometheus"},
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [{**t, "refId": chr(ord("A") + k)} for k, t in enumerate(targets)],
            })
            pid += 1
        y += 8 * ((len(row) + 2) // 3)
    return {
        "uid": "inflight-workers", "title": "Inflight workers", "schemaVersion": 39, "version": 1,
        "tags": ["inflight", "llm", "kafka"], "timezone": "browser", "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "panels": panels,
        "templating": {"list": []}, "annotations": {"list": []},
    }


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
