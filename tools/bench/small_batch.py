"""Float32 linear layers on the CPU (`worker/model/small_batch.py`), the three choices of
`model.cpu_linear` measured in one run on one box: one decode step of `--running` requests
(contexts of 64-192 tokens; `ModelRunner.execute` on the same step: packing, forward,
sampling) by three engines taking turns (`--rounds` of `--iterations` steps each, forward
compiled as by default): `torch` (torch's GEMM throughout), `inflight` (the fixed rule:
the small-batch kernel for a few rows, oneDNN's packed weights above) and `auto` (the
default: the fastest of the three per weight shape and row count, timed at load).
Median milliseconds, the medians of the per-round ratios, greedy ids compared.
`--threads` sets torch's intra-op threads (the worker's engine process takes one on a
2-core box, `worker.engine_threads`). Writes `bench_small_batch.json` under --out and
prints a table.

    python -m tools.bench.small_batch --running 1 2 4 8 16 32 --threads 1
"""

from __future__ import annotations

import argparse
import statistics

from tools.bench.harness import (
    decode_step,
    interleaved_ms,
    step_bench_args,
    step_bench_start,
    write_report,
)

POLICIES = ("torch", "inflight", "auto")  # `model.cpu_linear`, the engines in turn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    step_bench_args(p, running=[1, 2, 4, 8, 16, 32], rounds=15)
    a = p.parse_args(argv)
    path, report = step_bench_start(a)
    report["by_running"] = {}
    print(f"{'running':>8}{'torch ms':>10}{'inflight ms':>13}{'auto ms':>9}{'auto/torch':>12}{'auto/inflight':>15}"
          f"{'inflight/torch':>16}  greedy ids")
    for running in a.running:
        steps, ids, forward = {}, {}, None
        for policy in POLICIES:
            steps[policy], ids[policy], forward = decode_step(path, running, cpu_linear=policy)
        ms = interleaved_ms(steps, a.rounds, a.iterations)
        speedup = {f"{x}_vs_{y}": [slow / fast for fast, slow in zip(ms[x], ms[y])]
                   for x, y in (("auto", "torch"), ("auto", "inflight"), ("inflight", "torch"))}
        same = ids["torch"] == ids["inflight"] == ids["auto"]
        row = {"decode_step_ms": ms, "speedup_per_round": speedup,
               "speedup": {k: statistics.median(v) for k, v in speedup.items()},
               "greedy_ids_identical": same, "forward": forward}
        report["by_running"][str(running)] = row
        med = {k: statistics.median(v) for k, v in ms.items()}
        print(f"{running:>8}{med['torch']:>10.2f}{med['inflight']:>13.2f}{med['auto']:>9.2f}"
              + "".join(f"{row['speedup'][k]:>{w}.2f}x" for k, w in (("auto_vs_torch", 11), ("auto_vs_inflight", 14),
                                                                    ("inflight_vs_torch", 15)))
              + f"  {'identical' if same else 'differ'}")
    write_report(report, a.out, "bench_small_batch.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
