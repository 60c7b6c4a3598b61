"""Float32 linear layers at decode batch sizes (`worker/model/small_batch.py`) vs torch's
GEMM, measured in one run on one box: one decode step of `--running` requests (contexts
of 64-192 tokens; `ModelRunner.execute` on the same step: packing, forward, sampling), an
engine whose linear layers use the CPU small-batch kernel and one whose layers stay
`nn.Linear` taking turns (`--rounds` of `--iterations` steps each, forward compiled as by
default); median milliseconds, the median of the per-round ratios, greedy ids compared.
Writes `bench_small_batch.json` under --out and prints a table.

    python -m tools.bench.small_batch --running 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path

from tools.bench.harness import (
    DEFAULT_MODEL,
    decode_step,
    ensure_model,
    interleaved_ms,
    machine,
    write_report,
)


@contextlib.contextmanager
def torch_gemm_only():
    """Engines built inside keep their `nn.Linear` layers (the baseline)."""
    from worker.model import small_batch

    install = small_batch.install
    small_batch.install = lambda model: 0
    try:
        yield
    finally:
        small_batch.install = install


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF checkpoint dir (the CPU benchmark model is made "
                                                               "if missing)")
    p.add_argument("--running", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=15, help="turns each step takes")
    p.add_argument("--iterations", type=int, default=10, help="steps timed per turn")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    path = ensure_model(Path(a.model))
    report: dict = {"machine": machine(), "model": str(path), "rounds": a.rounds, "iterations_per_round": a.iterations,
                    "by_running": {}}
    print(f"{'running':>8}{'torch GEMM ms':>15}{'kernel ms':>11}{'speedup':>9}  per round   greedy ids")
    for running in a.running:
        with torch_gemm_only():
            gemm, gemm_ids, _ = decode_step(path, running)
        kernel, kernel_ids, forward = decode_step(path, running)
        ms = interleaved_ms({"torch_gemm": gemm, "kernel": kernel}, a.rounds, a.iterations)
        ratios = [g / k for g, k in zip(ms["torch_gemm"], ms["kernel"])]
        row = {"decode_step_ms": ms, "speedup_per_round": ratios, "speedup": statistics.median(ratios),
               "greedy_ids_identical": gemm_ids == kernel_ids, "forward": forward}
        report["by_running"][str(running)] = row
        print(f"{running:>8}{statistics.median(ms['torch_gemm']):>15.2f}{statistics.median(ms['kernel']):>11.2f}"
              f"{row['speedup']:>8.2f}x  {min(ratios):.2f}-{max(ratios):.2f}x  {'identical' if gemm_ids == kernel_ids else 'differ'}")
    write_report(report, a.out, "bench_small_batch.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
