"""The KV cache in int8 (`serving_tuning.kv_cache_dtype: int8`) vs the model's dtype, at the
same bytes (`serving_tuning.kv_cache_bytes`), on a KV-bound workload, measured in one run.

Offline, the engine alone: `--requests` requests of `--prompt-len` (a range) prompt tokens
decoding `--output-len` tokens each (EOS ignored, greedy), all queued at once, `max_running_requests`
high enough that the KV cache is what limits the batch. Per dtype: the KV tokens the bytes
hold, running requests (mean and peak over the steps), preemptions, output tokens/s; each
engine run `--repeats` times in turn, medians. Writes `bench_kv_cache.json` under --out.

    python -m tools.bench.kv_cache --kv-mib 6 --requests 64
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from tools.bench.harness import DEFAULT_MODEL, ensure_model, machine, write_report


def run_once(path: Path, kv_dtype: str, kv_bytes: int, requests: int, prompt_len: tuple[int, int],
             output_len: int, attention_backend: str = "auto") -> dict:
    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine

    eng = Engine.from_pretrained(str(path), EngineConfig(
        model=ModelConfig(device="cpu", attention_backend=attention_backend),
        serving_tuning=ServingTuning(kv_cache_bytes=kv_bytes, kv_cache_dtype=kv_dtype, max_running_requests=256,
                                     max_batched_tokens=2048, enable_prefix_caching=False)))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i in range(requests):
        prompt = [rng.randrange(5, eng.facts.vocab_size) for _ in range(rng.randint(*prompt_len))]
        eng.add_request(f"r{i}", prompt_token_ids=prompt, params=params)
    running, tokens = [], 0
    t0 = time.perf_counter()
    while eng.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in eng.step())
        s = eng.last_step_stats
        if s is not None:
            running.append(s.num_running)
    seconds = time.perf_counter() - t0
    return {"kv_tokens": eng.facts.kv_capacity_tokens, "mean_running": statistics.mean(running),
            "peak_running": max(running), "preemptions": eng.scheduler.num_preemptions_total,
            "output_tokens_per_s": tokens / seconds, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF checkpoint dir (the CPU benchmark model is made "
                                                               "if missing)")
    p.add_argument("--kv-mib", type=float, default=6.0, help="KV cache bytes for both dtypes, MiB")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[64, 128], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=192)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"])
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    path = ensure_model(Path(a.model))
    kv_bytes = int(a.kv_mib * 2**20)
    runs: dict[str, list[dict]] = {"auto": [], "int8": []}
    for _ in range(a.repeats):
        for dtype in runs:
            runs[dtype].append(run_once(path, dtype, kv_bytes, a.requests, tuple(a.prompt_len), a.output_len,
                                        a.attention_backend))
    summary = {dtype: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for dtype, rs in runs.items()}
    ratios = {k: summary["int8"][k] / summary["auto"][k]
              for k in ("kv_tokens", "mean_running", "peak_running", "output_tokens_per_s")}
    report = {"machine": machine(), "model": str(path), "attention_backend": a.attention_backend,
              "kv_cache_bytes": kv_bytes, "requests": a.requests, "prompt_len": a.prompt_len,
              "output_len": a.output_len, "repeats": a.repeats, "runs": runs, "median": summary,
              "int8_vs_auto": ratios}
    for dtype, m in summary.items():
        print(f"kv_cache_dtype {dtype:<5} {m['kv_tokens']:7.0f} KV tokens, running mean {m['mean_running']:6.1f} "
              f"peak {m['peak_running']:4.0f}, preemptions {m['preemptions']:4.0f}, "
              f"{m['output_tokens_per_s']:7.1f} output tokens/s")
    print("int8 / auto: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    write_report(report, a.out, "bench_kv_cache.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
