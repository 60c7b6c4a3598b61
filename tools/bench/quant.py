"""Quantized weights vs the float model (`model.quantization`), measured in one run on one box.

One decode step of `--running` requests (contexts of 64-192 tokens) on the weights
benchmark model (~160M parameters, random-init Llama, fp32 weights of 640 MB: more than
the benchmark box's caches, so a step reads its weights from memory as a real model's
does), for each scheme: fp32, W8A8 int8, W8A16 int8 and W4A16 int4 (groups of 128),
quantized at load. The engines' steps take turns (`--rounds` of `--iterations` steps);
median milliseconds, the median of the per-round ratios to fp32, the weights' resident
bytes, and how many of the step's greedy ids equal fp32's (quantization changes them:
informational, not a check).

    python -m tools.bench.quant --running 1 32
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tools.bench.harness import (
    WEIGHTS_MODEL,
    decode_step,
    ensure_model,
    interleaved_ms,
    machine,
    write_report,
)

SCHEMES = ("none", "w8a8_int8", "int8", "int4")


def weight_bytes(path: Path, quantization: str) -> int:
    """Resident bytes of the loaded model's parameters and buffers under `quantization`."""
    from worker.config import ModelConfig
    from worker.model.loader import load_model
    from worker.model.quant_load import weight_bytes as count

    return count(load_model(ModelConfig(path=str(path), device="cpu", quantization=quantization,
                                        load_check=False)).model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(WEIGHTS_MODEL), help="HF checkpoint dir (the weights benchmark model is "
                                                                "made if missing)")
    p.add_argument("--running", type=int, nargs="+", default=[1, 32], help="decoding requests in the timed step")
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="model.compile of every engine")
    p.add_argument("--rounds", type=int, default=8, help="turns each step takes")
    p.add_argument("--iterations", type=int, default=5, help="steps timed per turn")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    path = ensure_model(Path(a.model))
    report: dict = {"machine": machine(), "model": str(path), "compile": a.compile, "rounds": a.rounds,
                    "iterations_per_round": a.iterations, "weight_bytes": {}, "by_running": {}}
    for q in a.schemes:
        report["weight_bytes"][q] = weight_bytes(path, q)
    for running in a.running:
        steps, ids, forward = {}, {}, {}
        for q in a.schemes:
            steps[q], ids[q], forward[q] = decode_step(path, running, compile=a.compile, quantization=q)
        ms = interleaved_ms(steps, a.rounds, a.iterations)
        base = a.schemes[0]
        row = {"step_ms": ms, "forward": forward, "speedup_vs_" + base: {}, "greedy_ids_equal_" + base: {}}
        print(f"decode step at {running} running ({forward[base]}):")
        for q in a.schemes:
            ratio = statistics.median(b / t for b, t in zip(ms[base], ms[q]))
            same = sum(x == y for x, y in zip(ids[q], ids[base]))
            row["speedup_vs_" + base][q] = ratio
            row["greedy_ids_equal_" + base][q] = same
            print(f"  {q:<10} {statistics.median(ms[q]):8.1f} ms  {ratio:5.2f}x {base}  weights "
                  f"{report['weight_bytes'][q] / 2**20:7.0f} MiB  greedy ids equal to {base}: {same}/{len(ids[base])}")
        report["by_running"][str(running)] = row
    write_report(report, a.out, "bench_quant.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
