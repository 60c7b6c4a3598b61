"""The main job end to end: Kafka in, continuous batching, Redis token streams out.

Uses the dev stack (tools/stack/devstack.sh up, done by tools/demo.sh), makes a small Llama
checkpoint on first run (tokenizer trained on the Python standard library's
docstrings, model trained for 400 steps: about two minutes on 2 CPU cores, cached in
.cache/models/demo-llama), runs a worker in this process, submits six jobs of the three
priorities through Kafka, streams one job's tokens live from Redis pub/sub while the
others run in the same batch, cancels another mid-stream and shows its KV blocks freed.
The cancelled job asks for `--victim-tokens` tokens with EOS ignored, so it is still
running when the cancel arrives; every outcome printed is read back (finish reasons from
the events, the block table from the engine), never assumed.

    python -m tools.demo [--kafka 127.0.0.1:19092] [--redis redis://127.0.0.1:6390/0] [--prefix inflight]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

DEMO_MODEL = Path(".cache/models/demo-llama")
CANCEL_AFTER = 6  # token events of the victim seen before the demo cancels it
PROMPTS = [
    ("high", "Return the number of"),
    ("normal", "This module provides"),
    ("normal", "The default value is"),
    ("low", "Raise an exception if"),
    ("low", "If the file does not exist,"),
    ("high", "Create a new"),
]


async def run(a: argparse.Namespace) -> int:
    from schemas.params import SamplingParams
    from schemas.wire import Finished, Started, Token
    from worker.cli.topics import create_topics
    from worker.client import InflightClient
    from worker.config import load_config
    from worker.engine import Engine
    from worker.obs.log import setup_logging
    from worker.serve.worker import Worker

    setup_logging("WARNING")
    await create_topics(a.kafka, a.prefix, partitions=6)  # the dev stack made the default prefix's; others here
    cfg = load_config(None, {
        "INFLIGHT_MODEL__PATH": str(a.model),
        "INFLIGHT_KAFKA__BOOTSTRAP_SERVERS": a.kafka,
        "INFLIGHT_KAFKA__GROUP_ID": f"inflight-demo-{uuid.uuid4().hex[:6]}",
        "INFLIGHT_REDIS__URL": a.redis,
        "INFLIGHT_KAFKA__TOPIC_PREFIX": a.prefix,
        "INFLIGHT_REDIS__KEY_PREFIX": a.prefix,
        "INFLIGHT_SERVING_TUNING__MAX_RUNNING_REQUESTS": "4",
        "INFLIGHT_SERVING_TUNING__MAX_TOTAL_TOKENS": "2048",
        "INFLIGHT_SERVING_TUNING__MAX_BATCHED_TOKENS": "64",
        "INFLIGHT_METRICS__PORT": "0",  # any free port: the demo never clashes with a running worker
        "INFLIGHT_METRICS__HOST": "127.0.0.1",
    })
    engine = Engine.from_pretrained(cfg.model.path, cfg.engine)
    worker = Worker(cfg, engine=engine)
    task = asyncio.create_task(worker.run(install_signals=False))
    while not (worker.started.is_set() and worker.intake.consumer.assignment()):
        if task.done():
            return task.result() or 1
        await asyncio.sleep(0.1)
    print(f"worker {worker.worker_id} is up: {engine.kv_stats().total_blocks} KV blocks of "
          f"{engine.kv_stats().block_size} tokens, at most 4 requests running; "
          f"metrics on http://127.0.0.1:{worker.server.port}/metrics\n")

    tag = uuid.uuid4().hex[:4]
    async with InflightClient(a.kafka, a.redis, topic_prefix=a.prefix, key_prefix=a.prefix) as client:
        ids = []
        for i, (prio, prompt) in enumerate(PROMPTS):
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0.7, top_p=0.9, seed=i)
            if i == 1:  # the job cancelled below: long enough that it cannot end before the cancel lands
                params = SamplingParams(max_tokens=a.victim_tokens, temperature=0.7, top_p=0.9, seed=i,
                                        ignore_eos=True)
            ids.append(await client.submit(prompt, params=params, priority=prio, job_id=f"demo-{tag}-{prio}-{i}"))
        print("submitted to Kafka:", ", ".join(ids), "\n")
        live, victim = ids[0], ids[1]
        texts: dict[str, str] = {}
        lines: list[str] = []

        async def follow(job_id: str) -> None:
            n = 0
            async for ev in client.stream(job_id, timeout_s=120):
                if isinstance(ev, Started) and job_id == live:
                    sys.stdout.write(f"[{job_id}] {PROMPTS[0][1]}")
                elif isinstance(ev, Token):
                    n += 1
                    if job_id == live:
                        sys.stdout.write(ev.text)
                        sys.stdout.flush()
                    if job_id == victim and n == CANCEL_AFTER:
                        blocks = len(engine.kv.block_table(job_id))
                        lines.append(f"cancelling {job_id} after {n} token events; it holds {blocks} KV block(s)")
                        await client.cancel(job_id)
                elif isinstance(ev, Finished):
                    texts[job_id] = ev.text
                    extra = ""
                    if job_id == victim:
                        table = engine.kv.block_table(job_id)
                        if ev.finish_reason != "cancelled":
                            extra = f"; the cancel did not take effect: it ended {ev.finish_reason} first"
                        elif table:
                            extra = f"; cancelled, but its block table still holds {len(table)} block(s)"
                        else:
                            extra = "; cancelled: its block table is now [] (its KV blocks are free)"
                    lines.append(f"{job_id}: finished ({ev.finish_reason}, {ev.usage.completion_tokens if ev.usage else 0} "
                                 f"tokens, TTFT {ev.timings.ttft_s * 1000 if ev.timings and ev.timings.ttft_s else 0:.0f} ms){extra}")

        t0 = time.monotonic()
        await asyncio.gather(*(follow(j) for j in ids))
        print("\n")
        for line in lines:
            print("  " + line)
        print(f"\nall {len(ids)} jobs done in {time.monotonic() - t0:.1f} s. Texts (prompt + completion):")
        for (prio, prompt), j in zip(PROMPTS, ids):
            print(f"  [{prio:>6}] {prompt}{texts.get(j, '')!r}")
    await asyncio.sleep(0.6)  # let the engine thread's idle refresh reach the gauges
    print(f"\nfrom the worker's /metrics (port {worker.server.port}):")
    print(metrics_summary(worker))
    worker.request_stop()
    await task
    s = engine.kv_stats()
    print(f"\nKV cache now: {s.used_blocks} used, {s.cached_blocks} cached prefixes, {s.free_blocks} free of "
          f"{s.total_blocks} blocks")
    return 0


def metrics_summary(worker) -> str:
    """A few of the worker's Prometheus series, read from its registry (what /metrics serves)."""
    reg = worker.metrics.registry

    def v(name, **labels):
        return reg.get_sample_value(name, labels) or 0.0

    reasons = ", ".join(f"{r} {v('request_finished_total', finish_reason=r):.0f}" for r in ("stop", "length", "cancelled")
                        if v("request_finished_total", finish_reason=r))
    ttft_n = sum(v("llm_ttft_seconds_count", priority=p) for p in ("high", "normal", "low"))
    ttft_sum = sum(v("llm_ttft_seconds_sum", priority=p) for p in ("high", "normal", "low"))
    return "\n".join([
        f"  request_finished_total: {reasons}",
        f"  llm_ttft_seconds: {ttft_n:.0f} observations, mean {1000 * ttft_sum / max(ttft_n, 1):.0f} ms",
        f"  generation_tokens_total {v('generation_tokens_total'):.0f}, request_abort_total{{cancelled}} "
        f"{v('request_abort_total', reason='cancelled'):.0f}, cancel_to_free_seconds "
        f"{1000 * v('cancel_to_free_seconds_sum'):.0f} ms",
        f"  kv_cache_usage_ratio {v('kv_cache_usage_ratio'):.2f}, running_requests {v('running_requests'):.0f}",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--kafka", default="127.0.0.1:19092")
    p.add_argument("--redis", default="redis://127.0.0.1:6390/0")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per job (default %(default)s)")
    p.add_argument("--victim-tokens", type=int, default=400,
                   help="tokens the cancelled job asks for, EOS ignored (default %(default)s)")
    p.add_argument("--prefix", default="inflight", help="topic and Redis key prefix (default %(default)s)")
    a = p.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        from tools.make_model import make_checkpoint

        print(f"making a small Llama checkpoint in {a.model} (trained for 400 steps, about 2 minutes) ...")
        make_checkpoint(a.model, arch="llama", train_steps=400)
    return asyncio.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
