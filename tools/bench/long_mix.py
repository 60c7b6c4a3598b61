"""`python -m tools.bench.e2e --long-mix` (issue 28): short chat requests at medium load
plus a share of requests with prompts many times longer, through the same number of
`inflight worker` processes arranged as one pool and as two pools by prompt length.

    tools/stack/devstack.sh up
    python -m tools.bench.e2e --long-mix                        # ~4 min on 2 CPU cores
    python -m tools.bench.e2e --long-mix --workers 2 --long-share 0.05 --long-factor 20

Workload: short prompts of 32-96 tokens (uniform), long ones `--long-factor` times the
short mean (every request is long with probability `--long-share`), `--output` tokens each,
EOS ignored, Poisson arrivals. The rate is `--load` times the engine-alone request rate of
the same mix (measured first, in this process, all requests at t=0). Both fleets see the
same requests at the same times:

  - one pool: `--workers` workers in one consumer group, no pools;
  - two pools: `default` (prompts up to `--short-bound` tokens) and `long` (up to the
    engine's `max_input_tokens`), `--workers - 1` workers and one worker; the client
    routes by counting prompt ids (`InflightClient(pools=...)`).

Every worker has the same serving limits (KV tokens, batch, step budget). Reported per
fleet: the short requests' TTFT (client side: submit to first token) p50 / p99, the long
ones', output tokens/s over the run, completed requests and jobs forwarded between pools;
then two pools / one pool ratios. Writes results/bench_e2e_long_mix.json and a PNG.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from pathlib import Path

import numpy as np

SHORT_RANGE = (32, 96)


def long_mix_workload(n: int, *, vocab_size: int, long_share: float, long_factor: float, output: int,
                      seed: int = 0, avoid: int = 5):
    """`n` BenchRequests: short prompts in SHORT_RANGE tokens, long ones `long_factor`
    times the short mean with probability `long_share`; random ids in [avoid, vocab)."""
    from tools.bench.workloads import BenchRequest

    rng = random.Random(seed)
    long_len = int(long_factor * sum(SHORT_RANGE) / 2)
    out = []
    for i in range(n):
        is_long = rng.random() < long_share
        length = long_len if is_long else rng.randint(*SHORT_RANGE)
        out.append(BenchRequest(f"r{i}", [rng.randrange(avoid, vocab_size) for _ in range(length)], output,
                                "long" if is_long else "short"))
    return out


async def run_fleet(a, model: Path, device: str, two_pools: bool, work, arrivals) -> dict:
    """Start the fleet, offer `work` at `arrivals` (seconds), return its summary."""
    import msgspec
    import yaml

    from schemas.params import SamplingParams
    from schemas.pools import Pool, Pools
    from schemas.wire import Finished, Token
    from tools.bench.harness import WorkerProcess, percentiles
    from worker.cli.topics import create_topics
    from worker.client import InflightClient

    prefix = f"lmix{uuid.uuid4().hex[:8]}"
    pools = Pools([Pool(name="default", max_prompt_tokens=a.short_bound),
                   Pool(name="long", max_prompt_tokens=a.max_input)]) if two_pools else None
    await create_topics(a.kafka, prefix, partitions=3, kafka=a.kafka_cfg, pools=pools)
    out_dir = Path(a.out)
    names = (["default"] * (a.workers - 1) + ["long"]) if two_pools else ["default"] * a.workers
    workers = []
    base = yaml.safe_load(Path(a.config).read_text()) if a.config else {}
    env = {"INFLIGHT_SERVING_TUNING__MAX_INPUT_TOKENS": str(a.max_input)}
    for i, pool in enumerate(names):
        cfg = out_dir / f"bench_long_mix_{prefix}_{i}.yaml"
        cfg.write_text(yaml.safe_dump({**base, "pools": [msgspec.to_builtins(p) for p in pools.pools] if pools else [],
                                       "worker": {**base.get("worker", {}), "pool": pool,
                                                  "worker_id": f"{prefix}-{pool}-{i}"}}))
        a_i = _with_config(a, str(cfg))
        workers.append(WorkerProcess(a_i, model, device, prefix, out_dir / f"bench_long_mix_worker{i}.log", env))
    records = []
    try:
        for w in workers:
            await w.wait_ready(300)
        async with InflightClient(kafka=a.kafka_cfg, redis=a.redis_cfg, topic_prefix=prefix, key_prefix=prefix,
                                  pools=pools) as client:
            t0 = time.time() + 1.0

            async def one(i: int, req, at: float) -> None:
                rec = {"kind": req.shape, "input_tokens": len(req.prompt_token_ids), "submit_s": None,
                       "first_token_s": None, "finish_s": None, "output_tokens": 0, "finish_reason": None}
                records.append(rec)
                await asyncio.sleep(max(0.0, t0 + at - time.time()))
                rec["submit_s"] = time.time() - t0
                job_id = f"{prefix}-{i}"
                await client.submit(prompt_token_ids=req.prompt_token_ids, job_id=job_id,
                                    params=SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True))
                try:
                    async for ev in client.stream(job_id, timeout_s=a.duration * 4 + 300):
                        if isinstance(ev, Token):
                            if rec["first_token_s"] is None:
                                rec["first_token_s"] = time.time() - t0
                            rec["output_tokens"] += len(ev.token_ids)
                        elif isinstance(ev, Finished):
                            rec["finish_s"], rec["finish_reason"] = time.time() - t0, ev.finish_reason
                except TimeoutError:
                    rec["finish_reason"] = "timeout"

            await asyncio.gather(*(one(i, r, at) for i, (r, at) in enumerate(zip(work, arrivals))))
            await asyncio.sleep(1.5)
            forwarded = sum([(await w.metrics()).get("jobs_forwarded_total", 0.0) for w in workers])
    finally:
        for w in workers:
            w.stop()
    ok = [r for r in records if r["finish_reason"] in ("stop", "length")]
    ttft = {k: [r["first_token_s"] - r["submit_s"] for r in ok if r["kind"] == k and r["first_token_s"] is not None]
            for k in ("short", "long")}
    span = max(r["finish_s"] for r in ok) - min(r["submit_s"] for r in ok) if ok else 1e-9
    return {"fleet": "two pools" if two_pools else "one pool", "workers": names, "requests": len(records),
            "completed": len(ok), "forwarded": forwarded, "short_ttft_s": percentiles(ttft["short"]),
            "long_ttft_s": percentiles(ttft["long"]), "output_tokens_per_s": sum(r["output_tokens"] for r in ok) / span}


def _with_config(a, path: str):
    import copy

    b = copy.copy(a)
    b.config = path
    return b


def long_mix(a, model: Path, device: str) -> dict:
    """The experiment of the module docstring; returns the report."""
    from tqdm import tqdm
    from transformers import AutoConfig

    from tools.bench.engine import run_inflight
    from tools.bench.harness import kv_tokens, report_header
    from tools.bench.workloads import poisson_arrivals

    vocab = AutoConfig.from_pretrained(model).vocab_size
    long_len = int(a.long_factor * sum(SHORT_RANGE) / 2)
    if a.max_input < long_len:
        raise SystemExit(f"--max-input {a.max_input} is below the long prompts' {long_len} tokens: raise it")
    kw = dict(vocab_size=vocab, long_share=a.long_share, long_factor=a.long_factor, output=a.output)
    calib = long_mix_workload(a.baseline_requests, seed=a.seed, **kw)
    with tqdm(total=sum(r.max_tokens for r in calib), desc="engine alone", unit="tok") as pbar:
        secs, _ = run_inflight(model, calib, a.max_batch, kv_tokens(a), a.budget, pbar, device, a.backend)
    alone_rps = len(calib) / secs
    rate = a.rates[0] if a.rates else round(a.load * alone_rps, 3)
    n = max(8, math.ceil(rate * a.duration))
    work = long_mix_workload(n, seed=a.seed + 1, **kw)
    arrivals = poisson_arrivals(rate, n, seed=a.seed + 2)
    fleets = [asyncio.run(run_fleet(a, model, device, two, work, arrivals)) for two in (False, True)]
    one, two = fleets
    ratios = {"short_ttft_p99": two["short_ttft_s"]["p99"] / one["short_ttft_s"]["p99"],
              "short_ttft_p50": two["short_ttft_s"]["p50"] / one["short_ttft_s"]["p50"],
              "output_tokens_per_s": two["output_tokens_per_s"] / one["output_tokens_per_s"]}
    report = {**report_header("e2e_long_mix", a, model, device),
              "workload": {"short_prompt_tokens": SHORT_RANGE, "long_prompt_tokens": int(
                  a.long_factor * sum(SHORT_RANGE) / 2), "long_share": a.long_share, "output_tokens": a.output,
                  "requests": n, "long_requests": sum(r.shape == "long" for r in work)},
              "engine_alone_requests_per_s": alone_rps, "offered_rate": rate,
              "serving_tuning": {"max_running_requests": a.max_batch, "max_batched_tokens": a.budget,
                                 "max_total_tokens": kv_tokens(a), "max_input_tokens": a.max_input},
              "fleets": fleets, "two_pools_vs_one": ratios,
              "goals": {"short_ttft_p99": "<= 0.5", "output_tokens_per_s": ">= 0.9"}}
    print(f"\nlong mix: {n} requests at {rate} req/s ({a.load:.2f} of the engine alone's {alone_rps:.2f}), "
          f"{report['workload']['long_requests']} long")
    print(f"{'fleet':<11}{'short TTFT p50 ms':>18}{'p99 ms':>9}{'long TTFT p50 ms':>18}{'p99 ms':>9}"
          f"{'output tok/s':>14}{'completed':>11}{'forwarded':>11}")
    for f in fleets:
        s, lg = f["short_ttft_s"], f["long_ttft_s"] or {"p50": float("nan"), "p99": float("nan")}
        print(f"{f['fleet']:<11}{s['p50'] * 1e3:>18.1f}{s['p99'] * 1e3:>9.1f}{lg['p50'] * 1e3:>18.1f}"
              f"{lg['p99'] * 1e3:>9.1f}{f['output_tokens_per_s']:>14.1f}{f['completed']:>6}/{f['requests']:<4}"
              f"{f['forwarded']:>11.0f}")
    print(f"two pools / one pool: short TTFT p99 {ratios['short_ttft_p99']:.2f}x (goal <= 0.5), "
          f"output tokens/s {ratios['output_tokens_per_s']:.2f}x (goal >= 0.9)")
    _plot(report, Path(a.out) / "bench_e2e_long_mix.png")
    return report


def _plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = report["fleets"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(fleets))
    ax.bar(x - 0.2, [f["short_ttft_s"]["p50"] * 1e3 for f in fleets], 0.4, label="short TTFT p50")
    ax.bar(x + 0.2, [f["short_ttft_s"]["p99"] * 1e3 for f in fleets], 0.4, label="short TTFT p99")
    ax.set_xticks(x, [f["fleet"] for f in fleets])
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
