"""The host-memory KV tier (`serving_tuning.host_kv_bytes`) against recomputing, on the
engine alone, in one run.

1. **Restore vs recompute**: a request whose `--prefix-len`-token prefix was computed
   once and then evicted from the device's cache (a filler request takes every block),
   `--suffix-len` new tokens after it, one output token: its time from `add` to its
   last output, with the tier (the prefix is copied back) and without it (recomputed),
   and with the prefix still on the device for reference. `--rounds` fresh prefixes,
   the engines in turn, medians.
2. **Hit rate on a shared-prefix mix**: `--prefixes` distinct prefixes whose blocks do
   not fit the device's cache, `--mix-rounds` rounds of one request each, with an
   unbounded device cache, the small one alone, and the small one with the tier: prompt
   tokens served from cache after the first round, wall time, and that the greedy ids
   agree.

Writes `bench_host_kv.json` and `bench_host_kv.png` under --out.

    python -m tools.bench.host_kv                         # bench-llama, 1024-token prefix (~2 min)
    python -m tools.bench.host_kv --model .cache/models/bench-llama-160m --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from tools.bench.harness import DEFAULT_MODEL, MODEL_SHAPES, ensure_model, machine, write_report

BLOCK = 16


def make_engine(path: Path, device_tokens: int, host_blocks: int, max_batched: int):
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine
    from worker.engine.engine import kv_bytes_per_token

    def cfg(host_bytes: int | None) -> EngineConfig:
        return EngineConfig(model=ModelConfig(device="cpu", dtype="float32"), serving_tuning=ServingTuning(
            max_total_tokens=device_tokens, max_batched_tokens=max_batched, max_running_requests=4,
            kv_block_size=BLOCK, host_kv_bytes=host_bytes))

    engine = Engine.from_pretrained(str(path), cfg(None))
    if host_blocks:
        engine = Engine.from_pretrained(
            str(path), cfg(host_blocks * kv_bytes_per_token(engine.loaded, engine.tuning) * BLOCK))
    return engine


def run(engine, rid: str, prompt: list[int], max_tokens: int = 1) -> tuple[float, list[int], int]:
    """Seconds from add to the last output, the ids, the prompt tokens served from cache."""
    from schemas.params import SamplingParams

    ids: list[int] = []
    cached = 0
    t0 = time.perf_counter()
    engine.add_request(rid, prompt_token_ids=prompt,
                       params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            ids.extend(out.new_token_ids)
            if out.finished:
                cached = out.usage.cached_prompt_tokens
    return time.perf_counter() - t0, ids, cached


def restore_vs_recompute(a, path: Path) -> dict:
    device_tokens = a.prefix_len + a.suffix_len + 2 * BLOCK
    engines = {"host tier": make_engine(path, device_tokens, host_blocks=4 * a.prefix_len // BLOCK,
                                        max_batched=device_tokens),
               "recompute": make_engine(path, device_tokens, 0, max_batched=device_tokens)}
    vocab = engines["recompute"].facts.vocab_size
    rng = random.Random(0)
    times: dict[str, list[float]] = {"host tier": [], "recompute": [], "device hit": []}
    cached: dict[str, list[int]] = {k: [] for k in times}
    for r in range(a.rounds + 1):  # round 0 warms every path up (not counted)
        prefix = [rng.randrange(5, vocab) for _ in range(a.prefix_len)]
        filler = [rng.randrange(5, vocab) for _ in range(device_tokens - 1)]  # every block
        suffixes = [[rng.randrange(5, vocab) for _ in range(a.suffix_len)] for _ in range(3)]
        for name, engine in engines.items():
            run(engine, f"{r}-warm", prefix + suffixes[0])
            if name == "host tier":  # the prefix still on the device: the reference row
                t, _, c = run(engine, f"{r}-device", prefix + suffixes[1])
                if r:
                    times["device hit"].append(t)
                    cached["device hit"].append(c)
            run(engine, f"{r}-filler", filler)  # every block taken: the prefix is evicted
            t, _, c = run(engine, f"{r}-measured", prefix + suffixes[2])
            if r:
                times[name].append(t)
                cached[name].append(c)
    host = engines["host tier"]
    out = {name: {"ms_median": statistics.median(v) * 1000, "ms": [x * 1000 for x in v],
                  "cached_prompt_tokens": cached[name]} for name, v in times.items()}
    out["recompute_over_restore"] = out["recompute"]["ms_median"] / out["host tier"]["ms_median"]
    out["copy_ms_total"] = host.runner.host_kv.copy_s * 1000
    out["bytes_per_block"] = host.runner.host_kv.bytes_per_slot
    return out


def shared_prefix_mix(a, path: Path) -> dict:
    rng = random.Random(1)
    vocab = None
    prefix_blocks = a.prefix_len // BLOCK
    small = (a.prefixes * prefix_blocks // 2) * BLOCK  # half the prefixes' blocks
    systems = {"unbounded": (a.prefixes * (a.prefix_len + 64) * 2, 0), "device only": (small, 0),
               "device + host": (small, a.prefixes * prefix_blocks)}
    out: dict = {}
    reference = None
    for name, (device_tokens, host_blocks) in systems.items():
        engine = make_engine(path, device_tokens, host_blocks, max_batched=2048)
        vocab = vocab or engine.facts.vocab_size
        rng = random.Random(1)
        prefixes = [[rng.randrange(5, vocab) for _ in range(a.prefix_len)] for _ in range(a.prefixes)]
        hit = 0
        ids = []
        t0 = time.perf_counter()
        for r in range(a.mix_rounds):
            for p in range(a.prefixes):
                _, got, c = run(engine, f"{r}-{p}", prefixes[p] + [rng.randrange(5, vocab) for _ in range(8)], 4)
                ids.append(got)
                hit += c if r else 0
        seconds = time.perf_counter() - t0
        reference = reference or ids
        out[name] = {"device_tokens": device_tokens, "host_blocks": host_blocks, "hit_tokens": hit,
                     "seconds": seconds, "ids_equal_unbounded": ids == reference}
    for name in out:
        out[name]["hit_vs_unbounded"] = out[name]["hit_tokens"] / max(1, out["unbounded"]["hit_tokens"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--mix-rounds", type=int, default=3)
    p.add_argument("--parts", nargs="+", choices=("restore", "mix"), default=["restore", "mix"])
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    path = Path(a.model)
    if path in MODEL_SHAPES:  # a benchmark checkpoint: made if missing
        ensure_model(path)
    report = {"mode": "host_kv", "command": "python -m tools.bench.host_kv " + " ".join(argv or sys.argv[1:]),
              "machine": machine(), "model": str(path), "device": "cpu", "dtype": "float32",
              "prefix_len": a.prefix_len, "suffix_len": a.suffix_len}
    if "restore" in a.parts:
        _restore_part(a, path, report)
    if "mix" in a.parts:
        _mix_part(a, path, report)
    out = Path(a.out)
    write_report(report, out, "bench_host_kv.json")
    _plot(report, out / "bench_host_kv.png")
    return 0


def _restore_part(a, path: Path, report: dict) -> None:
    report["restore"] = rr = restore_vs_recompute(a, path)
    print(f"{a.prefix_len}-token prefix + {a.suffix_len} new tokens, 1 output token, median of {a.rounds}:")
    for name in ("device hit", "host tier", "recompute"):
        print(f"  {name:<11} {rr[name]['ms_median']:8.1f} ms   cached prompt tokens {rr[name]['cached_prompt_tokens']}")
    print(f"  recompute / restore: {rr['recompute_over_restore']:.2f}x  (copies {rr['copy_ms_total']:.1f} ms in all, "
          f"{rr['bytes_per_block']} bytes a block)")


def _mix_part(a, path: Path, report: dict) -> None:
    report["mix"] = mix = shared_prefix_mix(a, path)
    print(f"shared-prefix mix: {a.prefixes} prefixes x {a.mix_rounds} rounds, hits after round 1:")
    for name, row in mix.items():
        print(f"  {name:<13} device {row['device_tokens']:6d} tokens, host {row['host_blocks']:4d} blocks: "
              f"{row['hit_tokens']:6d} hit tokens ({row['hit_vs_unbounded']:.2f}x unbounded), {row['seconds']:.1f} s, "
              f"ids equal: {row['ids_equal_unbounded']}")


def _plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    if "restore" in report:
        rows = ["device hit", "host tier", "recompute"]
        left.bar(rows, [report["restore"][r]["ms_median"] for r in rows], color=["tab:green", "tab:blue", "tab:red"])
        left.set_ylabel("ms, add to first token (median)")
        left.set_title(f"{report['prefix_len']}-token prefix evicted from the device")
    if "mix" in report:
        names = list(report["mix"])
        right.bar(names, [report["mix"][n]["hit_vs_unbounded"] for n in names], color="tab:blue")
        right.set_ylabel("prefix hit tokens / unbounded cache's")
        right.set_title("shared-prefix mix")
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    raise SystemExit(main())
