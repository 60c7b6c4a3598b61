"""Engines side by side on one host: tokens/s of K engine processes started at once, with
torch's default threads (one per core) and with the thread budget
(`worker.engine.threads`), in one run.

Each engine runs in its own core process through the worker's client
(`ProcessEngineClient`, as `worker.engine_process: true` does) on the CPU benchmark
model, greedy, EOS ignored. What is measured is the collapse OpenMP threads cause when
engines (or an engine and anything busy) share cores.

    python -m tools.bench.threads                       # K = 1 and 2, default vs budget
    python -m tools.bench.threads --engines 1 2 3 --requests 4 --tokens 500 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from tools.bench.harness import DEFAULT_MODEL, ensure_model


async def run_engines(model: Path, k: int, engine_threads: int | None, requests: int, tokens: int) -> dict:
    """Start `k` engine processes, give each `requests` x `tokens` greedy tokens at once
    (after all are ready), and return each engine's tokens/s and threads."""
    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ServingTuning
    from worker.engine.core_client import ProcessEngineClient
    from worker.engine.core_proc import PretrainedEngine
    from worker.engine.inputs import RequestInput

    tuning = ServingTuning(max_running_requests=32, max_total_tokens=32768, max_batched_tokens=512,
                           max_input_tokens=512)
    spec = PretrainedEngine(str(model), EngineConfig(serving_tuning=tuning))
    loop = asyncio.get_running_loop()
    clients, done, counts, ends = [], [], [], []
    for i in range(k):
        counts.append(0)
        ends.append(0.0)
        done.append(asyncio.Event())

        def on_outputs(outs, i=i):
            for o in outs:
                counts[i] += len(o.new_token_ids)
            if counts[i] >= requests * tokens:
                ends[i] = time.perf_counter()
                done[i].set()

        c = ProcessEngineClient(spec, tuning, engine_threads=engine_threads, log_level="WARNING")
        await c.start(loop, on_outputs, lambda e: print("engine crashed:", e, file=sys.stderr))
        clients.append(c)
    try:
        t0 = time.perf_counter()
        for i, c in enumerate(clients):
            for r in range(requests):
                c.submit(c.input.process(RequestInput.of(
                    f"e{i}-r{r}", prompt_token_ids=[(7 * r + j) % 2000 + 3 for j in range(32)],
                    params=SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))))
        async with asyncio.timeout(1800):
            await asyncio.gather(*(d.wait() for d in done))
        rates = [round(counts[i] / (ends[i] - t0), 1) for i in range(k)]
        return {"engines": k, "threads_setting": engine_threads, "threads": [c.engine_threads for c in clients],
                "tokens_per_s": rates, "total_tokens_per_s": round(sum(rates), 1)}
    finally:
        for c in clients:
            await asyncio.to_thread(c.stop)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2], help="engine counts to run (each at once)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=500, help="output tokens per request")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    model = ensure_model(Path(a.model))
    cores = os.cpu_count() or 1
    rows = []
    for k in a.engines:
        for label, setting in ((f"torch default ({cores} threads)", cores), ("thread budget", None)):
            r = asyncio.run(run_engines(model, k, setting, a.requests, a.tokens))
            r["config"] = label
            rows.append(r)
            print(f"{k} engine(s)  {label:<28} threads {r['threads']}  tok/s {r['tokens_per_s']}  "
                  f"total {r['total_tokens_per_s']}", flush=True)
    for k in a.engines:
        base, ours = (next(r for r in rows if r["engines"] == k and r["threads_setting"] == s) for s in (cores, None))
        print(f"{k} engine(s): budget / default = {ours['total_tokens_per_s'] / base['total_tokens_per_s']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"cores": cores, "requests": a.requests, "tokens": a.tokens,
                                            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
