"""Prefix affinity across a fleet (`kafka.affinity_prefix_bytes`, issue 51), through the
dev stack's Kafka and Redis, in one run.

Workload: `--prompts` distinct system prompts of about `--system-words` words, each
followed by a short unique question (`--jobs-per-prompt` jobs per prompt, shuffled),
`--max-tokens` greedy output tokens, produced at `--rate` jobs/s. Three fleets serve the
same jobs, each on fresh topics of `--partitions` partitions:

- `one worker`: every job on one worker, at a third of the rate (the same load per
  worker): the hit rate affinity aims for;
- `3 workers, unkeyed`: the producer's affinity off (jobs spread by id, as before);
- `3 workers, keyed`: affinity on;
- the last two again with every job produced at once (throughput at saturation).

Per fleet: the fleet's prefix-hit rate (prompt tokens served from a prefix cache / all
prompt tokens, from each job's `usage`), TTFT p50 / p95 (the workers' `timings.ttft_s`:
Kafka timestamp to first token), output tokens/s, wall time. Then the spreading rule on
the broker: `--hot-jobs` jobs produced with no worker reading, half of them with one
prompt, and each partition's records against the mean.

Writes `bench_affinity.json` and `bench_affinity.png` under --out. Needs the dev stack.

    tools/stack/devstack.sh up && python -m tools.bench.affinity          # ~4 min here
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

from tools.bench.harness import DEFAULT_MODEL, WorkerProcess, ensure_model, machine, percentiles, write_report

# name: (workers, affinity on, rate factor: x --rate; 0: every job produced at once)
FLEETS = {"one worker": (1, True, 1 / 3), "3 workers, unkeyed": (3, False, 1.0), "3 workers, keyed": (3, True, 1.0),
          "3 workers, unkeyed, all at once": (3, False, 0.0), "3 workers, keyed, all at once": (3, True, 0.0)}


def system_prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = ["order", "refund", "shipping", "policy", "customer", "invoice", "warranty", "store", "answer", "polite",
             "brief", "never", "always", "product", "return", "days", "receipt", "account", "support", "agent"]
    return [f"System {i}: " + " ".join(rng.choice(vocab) for _ in range(words)) for i in range(n)]


async def run_fleet(a, name: str, workers: int, keyed: bool, rate: float, jobs: list[tuple[str, str]],
                    log_dir: Path) -> dict:
    from worker.cli.topics import create_topics
    from worker.client import InflightClient
    from worker.config import KafkaConfig

    prefix = f"aff{uuid.uuid4().hex[:8]}"
    await create_topics(a.kafka, prefix, partitions=a.partitions)
    env = {"INFLIGHT_SERVING_TUNING__ENABLE_PREFIX_CACHING": "true", "INFLIGHT_MODEL__COMPILE": "off",
           "INFLIGHT_SERVING_TUNING__MAX_TOTAL_TOKENS": str(a.kv_tokens), "INFLIGHT_WORKER__LOG_LEVEL": "WARNING"}
    procs = [WorkerProcess(a, Path(a.model), "cpu", prefix, log_dir / f"bench_affinity_{i}.log", env)
             for i in range(workers)]
    try:
        await asyncio.gather(*(p.wait_ready(180) for p in procs))
        kafka = KafkaConfig(bootstrap_servers=a.kafka, topic_prefix=prefix,
                            affinity_prefix_bytes=a.prefix_bytes if keyed else 0)
        from schemas.params import SamplingParams

        params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
        async with InflightClient(kafka=kafka, redis_url=a.redis, key_prefix=prefix) as client:
            t0 = time.perf_counter()
            waits = []
            for i, (_, prompt) in enumerate(jobs):
                job_id = await client.submit(prompt, params=params)
                waits.append(asyncio.create_task(client.result(job_id, timeout_s=600)))
                if rate:
                    await asyncio.sleep(max(0.0, t0 + (i + 1) / rate - time.perf_counter()))
            finished = await asyncio.gather(*waits)
            wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.stop()
    prompt = sum(f.usage.prompt_tokens for f in finished if f.usage)
    cached = sum(f.usage.cached_prompt_tokens for f in finished if f.usage)
    out_tokens = sum(f.usage.completion_tokens for f in finished if f.usage)
    reasons = {}
    for f in finished:
        reasons[str(f.finish_reason)] = reasons.get(str(f.finish_reason), 0) + 1
    ttft = [f.timings.ttft_s for f in finished if f.timings and f.timings.ttft_s is not None]
    return {"workers": workers, "keyed": keyed, "rate": rate or None, "jobs": len(finished), "finish_reasons": reasons,
            "prompt_tokens": prompt, "cached_prompt_tokens": cached, "hit_rate": cached / max(1, prompt),
            "ttft_s": percentiles(ttft), "output_tokens_per_s": out_tokens / wall, "wall_s": wall}


async def hot_prefix_spread(a, prompts: list[str], num_partitions: int) -> dict:
    """`--hot-jobs` jobs, half with prompts[0]: records per partition, no worker reading."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    from schemas import keys
    from worker.cli.topics import create_topics
    from worker.client import InflightClient
    from worker.config import KafkaConfig

    prefix = f"aff{uuid.uuid4().hex[:8]}"
    await create_topics(a.kafka, prefix, partitions=num_partitions)
    rng = random.Random(3)
    kafka = KafkaConfig(bootstrap_servers=a.kafka, topic_prefix=prefix, affinity_prefix_bytes=a.prefix_bytes)
    async with InflightClient(kafka=kafka, redis_url=a.redis, key_prefix=prefix) as client:
        for i in range(a.hot_jobs):
            p = prompts[0] if rng.random() < 0.5 else rng.choice(prompts[1:])
            await client.submit(f"{p}\nQuestion {i}?")
    topic = keys.job_topic(prefix, "normal")
    c = AIOKafkaConsumer(bootstrap_servers=a.kafka)
    await c.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(num_partitions)]
        ends = await c.end_offsets(tps)
    finally:
        await c.stop()
    counts = [ends[tp] for tp in tps]
    mean = sum(counts) / len(counts)
    return {"partitions": num_partitions, "jobs": a.hot_jobs, "records_per_partition": counts,
            "max_over_mean": max(counts) / mean}


async def main_async(a) -> dict:
    prompts = system_prompts(a.prompts, a.system_words)
    rng = random.Random(1)
    jobs = [(p, f"{prompts[p]}\nQuestion {i} of prompt {p}?") for p in range(a.prompts) for i in range(a.jobs_per_prompt)]
    rng.shuffle(jobs)
    log_dir = Path(a.out)
    log_dir.mkdir(parents=True, exist_ok=True)
    report = {"fleets": {}}
    for name, (workers, keyed, factor) in FLEETS.items():
        row = report["fleets"][name] = await run_fleet(a, name, workers, keyed, a.rate * factor, jobs, log_dir)
        print(f"{name:<32} hit rate {row['hit_rate']:.3f}  TTFT p50 {row['ttft_s']['p50'] * 1000:7.1f} ms  "
              f"p95 {row['ttft_s']['p95'] * 1000:7.1f} ms  {row['output_tokens_per_s']:6.1f} output tokens/s  "
              f"{row['wall_s']:.1f} s  {row['finish_reasons']}")
    f = report["fleets"]
    one = f["one worker"]["hit_rate"]
    report["keyed_hit_rate_vs_one_worker"] = f["3 workers, keyed"]["hit_rate"] / one if one else None
    report["unkeyed_hit_rate_vs_one_worker"] = f["3 workers, unkeyed"]["hit_rate"] / one if one else None
    report["keyed_ttft_p50_vs_unkeyed"] = f["3 workers, keyed"]["ttft_s"]["p50"] / f["3 workers, unkeyed"]["ttft_s"]["p50"]
    report["keyed_tokens_per_s_vs_unkeyed"] = (f["3 workers, keyed, all at once"]["output_tokens_per_s"]
                                              / f["3 workers, unkeyed, all at once"]["output_tokens_per_s"])
    print(f"keyed hit rate / one worker's: {report['keyed_hit_rate_vs_one_worker']:.2f}x (unkeyed "
          f"{report['unkeyed_hit_rate_vs_one_worker']:.2f}x); keyed TTFT p50 / unkeyed "
          f"{report['keyed_ttft_p50_vs_unkeyed']:.2f}x; output tokens/s all at once keyed / unkeyed "
          f"{report['keyed_tokens_per_s_vs_unkeyed']:.2f}x")
    report["hot_prefix"] = []
    for n in a.hot_partitions:
        hot = await hot_prefix_spread(a, prompts, n)
        report["hot_prefix"].append(hot)
        print(f"one prompt on half of {hot['jobs']} jobs, {hot['partitions']} partitions: records "
              f"{hot['records_per_partition']}, max / mean {hot['max_over_mean']:.2f}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--kafka", default="127.0.0.1:19092")
    p.add_argument("--redis", default="redis://127.0.0.1:6390/0")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--system-words", type=int, default=170, help="words per system prompt (~500 tokens here)")
    p.add_argument("--jobs-per-prompt", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rate", type=float, default=8.0, help="jobs per second")
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--prefix-bytes", type=int, default=1024)
    p.add_argument("--kv-tokens", type=int, default=16384)
    p.add_argument("--hot-jobs", type=int, default=2000)
    p.add_argument("--hot-partitions", type=int, nargs="+", default=[3, 6])
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    ensure_model(Path(a.model))
    # what WorkerProcess reads of a benchmark's arguments
    a.backend, a.max_batch, a.budget, a.config, a.max_input, a.max_output = "auto", 16, 512, None, 1024, 64
    report = {"mode": "affinity", "command": "python -m tools.bench.affinity " + " ".join(argv or sys.argv[1:]),
              "machine": machine(), "model": a.model, "device": "cpu", "workload": {
                  k: getattr(a, k) for k in ("prompts", "system_words", "jobs_per_prompt", "max_tokens", "rate",
                                             "partitions", "prefix_bytes", "kv_tokens")}}
    report.update(asyncio.run(main_async(SimpleNamespace(**vars(a)))))
    out = Path(a.out)
    write_report(report, out, "bench_affinity.json")
    _plot(report, out / "bench_affinity.png")
    return 0


def _plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["fleets"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [report["fleets"][n]["hit_rate"] for n in names], color="tab:blue")
    left.set_ylabel("prefix-hit rate (cached / prompt tokens)")
    right.bar(names, [report["fleets"][n]["output_tokens_per_s"] for n in names], color="tab:orange")
    right.set_ylabel("output tokens/s")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=6, labelrotation=20)
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    raise SystemExit(main())
