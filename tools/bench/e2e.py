"""End-to-end load benchmark: Poisson arrivals produced to Kafka, tokens read back from
Redis by real subscribers, one `inflight worker` process in between (what a user runs).

For each request rate: requests of the chosen workload arrive as a Poisson process for
`--duration` seconds (or `--requests-per-rate`); each is submitted with
`InflightClient.submit` and consumed by its own subscriber (`--consumer stream`: the
pub/sub token stream; `result`: wait for the terminal event only). While it runs, the
worker's `/metrics` is sampled every 0.5 s (KV usage, running, waiting). Reported per
rate: output tokens/s, requests/s, TTFT / TPOT / e2e (client side) and queue time (worker
side, enqueue → first scheduled) at p50 / p95 / p99, KV usage over time, preemptions,
rejections, and whether the rate is *sustainable*: every request finished and the median
queue time of the last quarter of arrivals is at most max(2 × first quarter's, first
quarter's + 1 s), i.e. the queue did not keep growing.

Before the sweep the same engine runs the workload alone in this process (all requests at
t=0) for the engine-alone tokens/s; default rates are fractions of the request rate
that implies. Writes results/bench_e2e.json and two PNGs, prints a table.

`--tenant-flood` (issue 16) runs a different experiment instead of the sweep: a light
tenant sends short jobs as a Poisson stream at `--light-rate` for `--duration` seconds,
first alone, then while a flooding tenant has a backlog of `--flood-jobs` long jobs on
the same (normal) topic, submitted just before (it should outlast the light stream:
`flood_backlogged_throughout` says whether it did). Reported: the light tenant's TTFT
(client side, submit to first token) p50 / p99 in both phases and their ratio, also in
engine steps (a full batch's step is several times a near-empty one's on a CPU, so the
flood lengthens every step whatever the scheduler does), and the light tenant's share
of output tokens while the flood was there; with `--compare-off`,
the same again with `serving_tuning.fair_share: false` and no per-tenant cap on local
jobs (the worker before fair share). Writes results/bench_e2e_tenants.json.

    tools/stack/devstack.sh up
    python -m tools.bench.e2e                                   # default sweep, ~5 min on 2 CPU cores
    python -m tools.bench.e2e --rates 2 4 8 --duration 20 --consumer result
    python -m tools.bench.e2e --tenant-flood --compare-off      # ~4 min on 2 CPU cores
    python -m tools.bench.e2e --long-mix                        # pools by prompt length (tools/bench/long_mix.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tools.bench.connections import add_connection_args, connection_sections
from tools.bench.engine import add_size_args, run_inflight
from tools.bench.harness import (
    DEFAULT_MODEL,
    GPU_MODEL,
    WorkerProcess,
    apply_device_defaults,
    default_device,
    ensure_model,
    kv_tokens,
    percentiles,
    report_header,
)
from tools.bench.workloads import KINDS, TextTokens, make_workload, poisson_arrivals


async def run_rate(a, client, worker: WorkerProcess, rate: float, work, arrivals: list[float], tag: str) -> dict:
    from schemas.params import SamplingParams
    from schemas.wire import Finished, Token

    timeline: list[list[float]] = []
    before = await worker.metrics()
    records: list[dict] = []
    done = asyncio.Event()
    t0 = time.time()

    async def sample() -> None:
        while not done.is_set():
            try:
                m = await worker.metrics()
                timeline.append([round(time.time() - t0, 3), m.get("kv_cache_usage_ratio", 0.0),
                                 m.get("running_requests", 0.0), m.get("waiting_requests", 0.0)])
            except OSError:
                pass
            await asyncio.sleep(0.5)

    async def one(i: int, req, at: float, pbar) -> None:
        job_id = f"{tag}-{i}"
        rec = {"id": job_id, "shape": req.shape, "input_tokens": len(req.prompt_token_ids),
               "requested_tokens": req.max_tokens, "arrival_s": at, "submit_s": None, "first_token_s": None,
               "finish_s": None, "output_tokens": 0, "finish_reason": None, "server": None}
        records.append(rec)
        await asyncio.sleep(max(0.0, t0 + at - time.time()))
        params = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True)
        rec["submit_s"] = time.time() - t0
        await client.submit(prompt_token_ids=req.prompt_token_ids, params=params, job_id=job_id)
        timeout = a.duration * 4 + 300
        try:
            if a.consumer == "stream":
                async for ev in client.stream(job_id, timeout_s=timeout):
                    if isinstance(ev, Token):
                        if rec["first_token_s"] is None:
                            rec["first_token_s"] = time.time() - t0
                        rec["output_tokens"] += len(ev.token_ids)
                    elif isinstance(ev, Finished):
                        _finish(rec, ev, t0)
            else:
                ev = await client.result(job_id, timeout_s=timeout)
                _finish(rec, ev, t0)
                rec["output_tokens"] = ev.usage.completion_tokens if ev.usage else 0
        except TimeoutError:
            rec["finish_reason"] = "timeout"
        pbar.update(1)

    sampler = asyncio.create_task(sample())
    with tqdm(total=len(work), desc=f"{rate:.2f} req/s", unit="req") as pbar:
        await asyncio.gather(*(one(i, r, at, pbar) for i, (r, at) in enumerate(zip(work, arrivals))))
    done.set()
    await sampler
    await asyncio.sleep(1.5)  # let the worker's counters catch up with the last terminal events
    after = await worker.metrics()
    return summarize_rate(rate, records, timeline, before, after)


def _finish(rec: dict, ev, t0: float) -> None:
    rec["finish_s"] = time.time() - t0
    rec["finish_reason"] = ev.finish_reason
    t = ev.timings
    rec["server"] = {"queue_s": t.queue_s, "ttft_s": t.ttft_s, "tpot_s": t.tpot_s, "e2e_s": t.e2e_s} if t else None


def summarize_rate(rate: float, records: list[dict], timeline, before: dict, after: dict) -> dict:
    ok = [r for r in records if r["finish_reason"] in ("stop", "length")]
    out_tokens = sum(r["output_tokens"] for r in records)
    first_submit = min((r["submit_s"] for r in records if r["submit_s"] is not None), default=0.0)
    last_finish = max((r["finish_s"] for r in records if r["finish_s"] is not None), default=first_submit)
    span = max(last_finish - first_submit, 1e-9)
    ttft = [r["first_token_s"] - r["submit_s"] for r in ok if r["first_token_s"] is not None]
    if not ttft:  # result consumers see no tokens: the worker's TTFT (from the Kafka timestamp)
        ttft = [r["server"]["ttft_s"] for r in ok if r["server"] and r["server"]["ttft_s"] is not None]
    tpot = []
    for r in ok:
        if r["first_token_s"] is not None and r["output_tokens"] > 1:
            tpot.append((r["finish_s"] - r["first_token_s"]) / (r["output_tokens"] - 1))
        elif r["first_token_s"] is None and r["server"] and r["server"]["tpot_s"] is not None:
            tpot.append(r["server"]["tpot_s"])
    e2e = [r["finish_s"] - r["submit_s"] for r in ok]
    by_arrival = sorted((r for r in ok if r["server"] and r["server"]["queue_s"] is not None),
                        key=lambda r: r["arrival_s"])
    queue = [r["server"]["queue_s"] for r in by_arrival]
    q = max(1, len(queue) // 4)
    first_q = float(np.median(queue[:q])) if queue else 0.0
    last_q = float(np.median(queue[-q:])) if queue else 0.0
    sustainable = len(ok) == len(records) and last_q <= max(2 * first_q, first_q + 1.0)
    reasons: dict[str, int] = {}
    for r in records:
        reasons[str(r["finish_reason"])] = reasons.get(str(r["finish_reason"]), 0) + 1
    kv = [x[1] for x in timeline]
    return {
        "offered_rate": rate,
        "num_requests": len(records),
        "completed": len(ok),
        "finish_reasons": reasons,
        "duration_s": span,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / span,
        "requests_per_s": len(ok) / span,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "e2e_s": percentiles(e2e),
        "queue_s": percentiles(queue),
        "queue_first_quarter_p50_s": first_q,
        "queue_last_quarter_p50_s": last_q,
        "sustainable": sustainable,
        "kv_usage_mean": float(np.mean(kv)) if kv else 0.0,
        "kv_usage_max": float(np.max(kv)) if kv else 0.0,
        "preemptions": after.get("preemptions_total", 0.0) - before.get("preemptions_total", 0.0),
        "rejections": after.get("request_rejected_total", 0.0) - before.get("request_rejected_total", 0.0),
        "timeline": {"columns": ["t_s", "kv_cache_usage_ratio", "running_requests", "waiting_requests"],
                     "rows": timeline},
        "requests": records,
    }


# ---- the sweep ----------------------------------------------------------------------------
async def sweep(a, model: Path, device: str, text, engine_alone: dict) -> list[dict]:
    from worker.cli.topics import create_topics
    from worker.client import InflightClient

    prefix = f"bench{uuid.uuid4().hex[:8]}"
    await create_topics(a.kafka, prefix, partitions=3, kafka=a.kafka_cfg)
    out_dir = Path(a.out)
    worker = WorkerProcess(a, model, device, prefix, out_dir / "bench_e2e_worker.log")
    rows = []
    try:
        await worker.wait_ready(300)
        async with InflightClient(kafka=a.kafka_cfg, redis=a.redis_cfg, topic_prefix=prefix,
                                  key_prefix=prefix) as client:
            for k, rate in enumerate(a.rates):
                n = a.requests_per_rate or max(4, math.ceil(rate * a.duration))
                work = make_workload(a.workload, n, vocab_size=engine_alone["vocab_size"], scale=a.scale,
                                     seed=a.seed + 1 + k, max_input=a.max_input, max_output=a.max_output,
                                     avoid_ids=frozenset({0, 1, 2, 3, 4}), text=text)
                arrivals = poisson_arrivals(rate, n, seed=a.seed + 100 + k)
                rows.append(await run_rate(a, client, worker, rate, work, arrivals, f"{prefix}-r{k}"))
    finally:
        worker.stop()
    return rows


def engine_alone_run(a, model: Path, device: str, text) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    work = make_workload(a.workload, a.baseline_requests, vocab_size=vocab, scale=a.scale, seed=a.seed,
                         max_input=a.max_input, max_output=a.max_output, avoid_ids=frozenset({0, 1, 2, 3, 4}),
                         text=text)
    total_out = sum(r.max_tokens for r in work)
    with tqdm(total=total_out, desc="engine alone", unit="tok") as pbar:
        secs, _ = run_inflight(model, work, a.max_batch, kv_tokens(a), a.budget, pbar, device, a.backend)
    return {"num_requests": len(work), "seconds": secs, "output_tokens": total_out,
            "output_tokens_per_s": total_out / secs, "requests_per_s": len(work) / secs,
            "mean_output_tokens": total_out / len(work), "vocab_size": vocab}


def build_report(a, model: Path, device: str, engine_alone: dict, rows: list[dict]) -> dict:
    sustainable = [r for r in rows if r["sustainable"]]
    best = max(sustainable, key=lambda r: r["output_tokens_per_s"], default=None)
    peak = max(rows, key=lambda r: r["output_tokens_per_s"], default=None)
    # medium load: the rate nearest half the engine-alone request rate
    medium = min(rows, key=lambda r: abs(r["offered_rate"] - 0.5 * engine_alone["requests_per_s"]), default=None)
    goals = {}
    if peak is not None:
        goals["peak_e2e_vs_engine_alone"] = peak["output_tokens_per_s"] / engine_alone["output_tokens_per_s"]
    if best is not None:
        goals["max_sustainable_vs_engine_alone"] = best["output_tokens_per_s"] / engine_alone["output_tokens_per_s"]
    if medium is not None and medium["ttft_s"]:
        goals["medium_load_rate"] = medium["offered_rate"]
        goals["medium_load_ttft_p99_over_p50"] = medium["ttft_s"]["p99"] / max(medium["ttft_s"]["p50"], 1e-9)
    return {
        **report_header("e2e", a, model, device),
        "workload": {"kind": a.workload, "prompts": a.prompts, "scale": a.scale, "seed": a.seed,
                     "consumer": a.consumer, "duration_s": a.duration, "requests_per_rate": a.requests_per_rate},
        "serving_tuning": {"max_running_requests": a.max_batch, "max_batched_tokens": a.budget,
                           "max_total_tokens": kv_tokens(a)},
        "engine_alone": engine_alone,
        "rates": rows,
        "max_sustainable": None if best is None else {
            "offered_rate": best["offered_rate"], "output_tokens_per_s": best["output_tokens_per_s"],
            "requests_per_s": best["requests_per_s"]},
        "peak": None if peak is None else {"offered_rate": peak["offered_rate"],
                                           "output_tokens_per_s": peak["output_tokens_per_s"]},
        "goals": goals,
    }


def plot(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rates"]
    rates = [r["offered_rate"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label, style in (("ttft_s", "TTFT", "-o"), ("e2e_s", "e2e latency", "-s"), ("queue_s", "queue time", "-^")):
        for p, alpha in (("p50", 1.0), ("p99", 0.5)):
            ys = [r[key][p] if r[key] else float("nan") for r in rows]
            ax1.plot(rates, ys, style, alpha=alpha, label=f"{label} {p}")
    ax1.set_yscale("log")
    ax1.set_xlabel("offered load (requests / s)")
    ax1.set_ylabel("latency (s, log scale)")
    ax1.set_title("Latency percentiles vs request rate")
    ax1.legend(fontsize=7)
    ax2.plot(rates, [r["output_tokens_per_s"] for r in rows], "-o", label="end to end (Kafka → worker → Redis)")
    ax2.axhline(report["engine_alone"]["output_tokens_per_s"], color="gray", ls="--", label="engine alone, all at t=0")
    for r in rows:
        if not r["sustainable"]:
            ax2.plot(r["offered_rate"], r["output_tokens_per_s"], "rx", ms=10)
    ax2.set_xlabel("offered load (requests / s)")
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("Throughput vs request rate (x: queue not bounded)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    p1 = out / "bench_e2e_latency_throughput.png"
    fig.savefig(p1, dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 2.4 * max(1, len(rows))), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        tl = np.asarray(r["timeline"]["rows"], dtype=float).reshape(-1, 4)
        ax.plot(tl[:, 0], tl[:, 2], label="running requests")
        ax.plot(tl[:, 0], tl[:, 3], label="waiting requests")
        ax.set_ylabel("requests")
        ax.set_xlabel("time since the first arrival (s)")
        ax.set_title(f"{r['offered_rate']:.2f} req/s offered", fontsize=9)
        ax2 = ax.twinx()
        ax2.plot(tl[:, 0], tl[:, 1], color="tab:red", label="KV cache usage")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("KV usage (ratio)")
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper right")
    fig.tight_layout()
    p2 = out / "bench_e2e_timeline.png"
    fig.savefig(p2, dpi=100)
    plt.close(fig)
    return [p1, p2]


def print_table(report: dict) -> None:
    ea = report["engine_alone"]
    print(f"\nengine alone: {ea['output_tokens_per_s']:.0f} output tok/s ({ea['requests_per_s']:.2f} req/s)")
    hdr = (f"{'rate':>6}{'done':>7}{'tok/s':>8}{'req/s':>7}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}"
           f"{'e2e p50':>9}{'p99':>8}{'queue p99':>10}{'KV max':>8}{'preempt':>8}  sustainable")
    print(hdr)
    def g(r, k, p):
        return f"{r[k][p]:.3f}" if r[k] else "-"

    for r in report["rates"]:
        print(f"{r['offered_rate']:>6.2f}{r['completed']:>4}/{r['num_requests']:<3}{r['output_tokens_per_s']:>7.0f}"
              f"{r['requests_per_s']:>7.2f}{g(r, 'ttft_s', 'p50'):>10}{g(r, 'ttft_s', 'p99'):>8}"
              f"{g(r, 'tpot_s', 'p50'):>10}{g(r, 'e2e_s', 'p50'):>9}{g(r, 'e2e_s', 'p99'):>8}{g(r, 'queue_s', 'p99'):>10}{r['kv_usage_max']:>8.2f}"
              f"{r['preemptions']:>8.0f}  {'yes' if r['sustainable'] else 'NO'}")
    ms = report["max_sustainable"]
    if ms:
        print(f"max sustainable: {ms['output_tokens_per_s']:.0f} output tok/s at {ms['offered_rate']:.2f} req/s")
    for k, v in report["goals"].items():
        print(f"{k}: {v:.2f}")


# ---- tenant flood (issue 16) --------------------------------------------------------------
async def flood_phase(a, client, worker: WorkerProcess, tag: str, light, arrivals: list[float], flood) -> dict:
    """Submit `flood` (tenant `flood`) at once, then `light` (tenant `light`) at
    `arrivals`; stream the light jobs (TTFT, client side); the worker's mean engine step
    time while the light stream lasts."""
    from schemas.params import SamplingParams
    from schemas.wire import Token

    records: list[dict] = []
    if flood:
        await asyncio.gather(*(client.submit(prompt_token_ids=r.prompt_token_ids, job_id=f"{tag}-f{i}", tenant="flood",
                                             params=SamplingParams(temperature=0, max_tokens=r.max_tokens,
                                                                   ignore_eos=True))
                               for i, r in enumerate(flood)))
    t0 = time.time()
    m0 = await worker.metrics()

    async def one(i: int, r, at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.time()))
        job_id = f"{tag}-l{i}"
        rec = {"submit_s": time.time() - t0, "first_token_s": None, "tokens": 0}
        records.append(rec)
        await client.submit(prompt_token_ids=r.prompt_token_ids, job_id=job_id, tenant="light",
                            params=SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
        async for ev in client.stream(job_id, timeout_s=a.duration * 4 + 300):
            if isinstance(ev, Token):
                if rec["first_token_s"] is None:
                    rec["first_token_s"] = time.time() - t0
                rec["tokens"] += len(ev.token_ids)

    await asyncio.gather(*(one(i, r, at) for i, (r, at) in enumerate(zip(light, arrivals))))
    m1 = await worker.metrics()
    steps = m1.get("engine_step_duration_seconds_count", 0.0) - m0.get("engine_step_duration_seconds_count", 0.0)
    step_s = (m1.get("engine_step_duration_seconds_sum", 0.0) - m0.get("engine_step_duration_seconds_sum", 0.0)) / max(
        steps, 1.0)
    ttft = [r["first_token_s"] - r["submit_s"] for r in records if r["first_token_s"] is not None]
    return {"light_jobs": len(records), "light_ttft_s": percentiles(ttft), "light_span_s": time.time() - t0,
            "mean_step_s": step_s}


async def tenant_flood_run(a, model: Path, device: str, fair: bool, light, arrivals, flood) -> dict:
    from worker.cli.topics import create_topics
    from worker.client import InflightClient

    prefix = f"benchf{uuid.uuid4().hex[:8]}"
    await create_topics(a.kafka, prefix, partitions=3)
    env = {"INFLIGHT_WORKER__DRAIN_TIMEOUT_S": "1", "INFLIGHT_WORKER__MAX_LOCAL_JOBS": str(2 * a.max_batch)}
    if not fair:
        env.update({"INFLIGHT_SERVING_TUNING__FAIR_SHARE": "false",
                    "INFLIGHT_WORKER__MAX_LOCAL_JOBS_PER_TENANT": str(2 * a.max_batch)})
    worker = WorkerProcess(a, model, device, prefix, Path(a.out) / f"bench_e2e_tenants_{'on' if fair else 'off'}.log",
                           env)
    try:
        await worker.wait_ready(300)
        async with InflightClient(a.kafka, a.redis, topic_prefix=prefix, key_prefix=prefix) as client:
            alone = await flood_phase(a, client, worker, f"{prefix}-alone", light, arrivals, [])
            before = await worker.metrics_by_tenant()
            flooded = await flood_phase(a, client, worker, f"{prefix}-flood", light, arrivals, flood)
            after = await worker.metrics_by_tenant()
    finally:
        worker.stop()
    tokens = {t: after.get(t, 0.0) - before.get(t, 0.0) for t in ("light", "flood")}
    total = sum(tokens.values()) or 1.0
    flood_requested = sum(r.max_tokens for r in flood)
    ratio = flooded["light_ttft_s"]["p99"] / alone["light_ttft_s"]["p99"]
    ratio_steps = (flooded["light_ttft_s"]["p99"] / flooded["mean_step_s"]) / (
        alone["light_ttft_s"]["p99"] / alone["mean_step_s"])
    return {"fair_share": fair, "alone": alone, "flooded": flooded, "light_ttft_p99_ratio": ratio,
            "light_ttft_p99_ratio_in_steps": ratio_steps,
            "output_tokens_while_flooded": tokens, "light_token_share": tokens["light"] / total,
            # the flood still had jobs left when the light stream ended: it lasted the whole phase
            "flood_backlogged_throughout": tokens["flood"] < flood_requested}


def tenant_flood(a, model: Path, device: str) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    n_light = max(4, math.ceil(a.light_rate * a.duration))
    light = make_workload("alpaca", n_light, vocab_size=vocab, scale=a.scale, seed=a.seed, max_input=a.max_input,
                          max_output=a.light_max_tokens, avoid_ids=frozenset({0, 1, 2, 3, 4}))
    flood = make_workload("sharegpt", a.flood_jobs, vocab_size=vocab, scale=a.scale, seed=a.seed + 1,
                          max_input=a.max_input, max_output=a.max_output, avoid_ids=frozenset({0, 1, 2, 3, 4}))
    arrivals = poisson_arrivals(a.light_rate, n_light, seed=a.seed + 2)
    runs = [asyncio.run(tenant_flood_run(a, model, device, True, light, arrivals, flood))]
    if a.compare_off:
        runs.append(asyncio.run(tenant_flood_run(a, model, device, False, light, arrivals, flood)))
    report = {**report_header("e2e_tenants", a, model, device),
              "serving_tuning": {"max_running_requests": a.max_batch, "max_batched_tokens": a.budget,
                                 "max_total_tokens": kv_tokens(a), "max_local_jobs": 2 * a.max_batch},
              "light": {"rate": a.light_rate, "jobs": n_light, "mean_input": _mean_in(light),
                        "mean_output": _mean_out(light)},
              "flood": {"jobs": len(flood), "mean_input": _mean_in(flood), "mean_output": _mean_out(flood)},
              "runs": runs}
    print(f"\nlight tenant {a.light_rate} req/s ({report['light']['mean_output']:.0f} output tokens), flood "
          f"{len(flood)} jobs ({report['flood']['mean_output']:.0f} output tokens), max batch {a.max_batch}")
    print(f"{'fair share':<12}{'TTFT p50 alone':>16}{'p99 alone':>11}{'p50 flood':>11}{'p99 flood':>11}"
          f"{'p99 ratio':>11}{'step ms alone':>15}{'flood':>7}{'ratio in steps':>16}{'light tokens':>14}")
    for r in runs:
        al, fl = r["alone"]["light_ttft_s"], r["flooded"]["light_ttft_s"]
        print(f"{'on' if r['fair_share'] else 'off':<12}{al['p50']:>16.3f}{al['p99']:>11.3f}{fl['p50']:>11.3f}"
              f"{fl['p99']:>11.3f}{r['light_ttft_p99_ratio']:>11.2f}{1e3 * r['alone']['mean_step_s']:>15.1f}"
              f"{1e3 * r['flooded']['mean_step_s']:>7.1f}{r['light_ttft_p99_ratio_in_steps']:>16.2f}"
              f"{r['light_token_share']:>14.3f}{'' if r['flood_backlogged_throughout'] else '  (flood ended early)'}")
    return report


def _mean_in(work) -> float:
    return sum(len(r.prompt_token_ids) for r in work) / len(work)


def _mean_out(work) -> float:
    return sum(r.max_tokens for r in work) / len(work)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results", help="folder for JSON, PNGs and the worker log")
    add_connection_args(p)
    p.add_argument("--model", default=None,
                   help=f"HF checkpoint dir (default {DEFAULT_MODEL} on CPU, {GPU_MODEL} on CUDA; made if missing)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--workload", default="mixed", choices=sorted(KINDS))
    p.add_argument("--prompts", default="text", choices=["text", "random"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="requests/s to offer; default: --load-fractions of the engine-alone request rate")
    p.add_argument("--load-fractions", type=float, nargs="+", default=[0.25, 0.5, 0.8, 1.0, 1.3])
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--requests-per-rate", type=int, default=None, help="fixed count instead of --duration")
    p.add_argument("--baseline-requests", type=int, default=128, help="requests of the engine-alone run")
    p.add_argument("--consumer", default="stream", choices=["stream", "result"])
    p.add_argument("--tenant-flood", action="store_true",
                   help="light tenant's TTFT without and with a flooding tenant (see above) instead of the sweep")
    p.add_argument("--light-rate", type=float, default=2.0, help="light tenant's requests/s (--tenant-flood)")
    p.add_argument("--light-max-tokens", type=int, default=32, help="cap on the light jobs' output tokens")
    p.add_argument("--flood-jobs", type=int, default=1000,
                   help="flooding tenant's backlog (--tenant-flood); enough to outlast --duration")
    p.add_argument("--compare-off", action="store_true", help="also run with fair share off (--tenant-flood)")
    p.add_argument("--long-mix", action="store_true",
                   help="short requests with a share of long ones, one pool vs two pools by prompt length, same "
                        "workers (tools/bench/long_mix.py) instead of the sweep")
    p.add_argument("--workers", type=int, default=2, help="workers of each fleet (--long-mix)")
    p.add_argument("--long-share", type=float, default=0.05, help="share of long requests (--long-mix)")
    p.add_argument("--long-factor", type=float, default=20.0, help="long prompt / mean short prompt (--long-mix)")
    p.add_argument("--output", type=int, default=32, help="output tokens per request (--long-mix)")
    p.add_argument("--short-bound", type=int, default=256, help="the default pool's max_prompt_tokens (--long-mix)")
    p.add_argument("--load", type=float, default=0.5,
                   help="offered rate as a fraction of the engine-alone request rate of the mix (--long-mix)")
    add_size_args(p)
    a = p.parse_args(argv)
    a.kafka_cfg, a.redis_cfg = connection_sections(a)
    a.command_line = "python -m tools.bench.e2e " + " ".join(argv if argv is not None else sys.argv[1:])
    device = a.device if a.device != "auto" else default_device()
    if a.tenant_flood and a.max_batch is None:
        a.max_batch = 8  # a small batch: the flood holds every slot unless shared
    if a.long_mix and a.max_input is None:
        a.max_input = 1536  # room for the long prompts (20 x 64 tokens)
    apply_device_defaults(a, device)
    model = ensure_model(Path(a.model) if a.model else (GPU_MODEL if device == "cuda" else DEFAULT_MODEL))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.long_mix:
        from tools.bench.long_mix import long_mix

        report = long_mix(a, model, device)
        path = out / "bench_e2e_long_mix.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
        return 0
    if a.tenant_flood:
        report = tenant_flood(a, model, device)
        path = out / "bench_e2e_tenants.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
        return 0
    text = None
    if a.prompts == "text":
        from transformers import AutoTokenizer

        text = TextTokens(AutoTokenizer.from_pretrained(model))
    engine_alone = engine_alone_run(a, model, device, text)
    if a.rates is None:
        a.rates = [round(f * engine_alone["requests_per_s"], 3) for f in a.load_fractions]
    rows = asyncio.run(sweep(a, model, device, text, engine_alone))
    report = build_report(a, model, device, engine_alone, rows)
    path = out / "bench_e2e.json"
    path.write_text(json.dumps(report, indent=2))
    pngs = plot(report, out)
    print_table(report)
    print(f"wrote {path}, {', '.join(str(x) for x in pngs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
