"""CPU decode attention (`model.attention_backend`): the `cpu` back end (decodes by the C
kernel reading KV blocks in place, `worker/model/kernels/cpu_decode.c`) against `torch`
(the plain-torch reference: gathers each context, then SDPA), measured in one run on one
box: one decode step of `--running` requests with contexts of 64-192 tokens and of
`--context` tokens (`ModelRunner.execute` on the same step: packing, forward, sampling),
the two engines taking turns (`--rounds` of `--iterations` steps each, forward compiled
as by default). Median milliseconds, the median of the per-round ratios, greedy ids
compared. `--threads` sets torch's intra-op threads, which the kernel spreads its rows
over. Writes `bench_attention.json` under --out and prints a table.

    python -m tools.bench.attention --threads 2
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

BACKENDS = ("cpu", "torch")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    step_bench_args(p, running=[1, 8, 32], rounds=7)
    p.add_argument("--context", type=int, default=1024, help="the long contexts' tokens")
    a = p.parse_args(argv)
    path, report = step_bench_start(a)
    report["rows"] = []
    print(f"{'running':>8}{'context':>10}{'cpu ms':>9}{'torch ms':>10}{'cpu faster':>12}  greedy ids")
    for running in a.running:
        for context in (None, a.context):
            steps, ids = {}, {}
            for backend in BACKENDS:
                steps[backend], ids[backend], _ = decode_step(path, running, context=context,
                                                              attention_backend=backend)
            ms = interleaved_ms(steps, a.rounds, a.iterations)
            speedup = [ref / kernel for kernel, ref in zip(ms["cpu"], ms["torch"])]
            same = ids["cpu"] == ids["torch"]
            label = "64-192" if context is None else str(context)
            report["rows"].append({"running": running, "context": label, "decode_step_ms": ms,
                                   "speedup_per_round": speedup, "speedup": statistics.median(speedup),
                                   "greedy_ids_identical": same})
            print(f"{running:>8}{label:>10}{statistics.median(ms['cpu']):>9.2f}{statistics.median(ms['torch']):>10.2f}"
                  f"{statistics.median(speedup):>11.2f}x  {'identical' if same else 'differ'}")
    write_report(report, a.out, "bench_attention.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
