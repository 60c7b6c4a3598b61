"""Float32 linear layers on the CPU (`worker/model/small_batch.py`) vs torch's GEMM,
measured in one run on one box: one decode step of `--running` requests (contexts of
64-192 tokens; `ModelRunner.execute` on the same step: packing, forward, sampling) by three
engines taking turns (`--rounds` of `--iterations` steps each, forward compiled as by
default): layers as `small_batch.install` makes them (the small-batch kernel, oneDNN's
packed weights above it), the kernel alone (weights not packed, torch's GEMM above it),
and plain `nn.Linear` layers (torch's GEMM throughout). Median milliseconds, the medians
of the per-round ratios, greedy ids compared. `--threads` sets torch's intra-op threads
(the worker's engine process takes one on a 2-core box, `worker.engine.threads`). Writes
`bench_small_batch.json` under --out and prints a table.

    python -m tools.bench.small_batch --running 1 2 4 8 16 32 --threads 1
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
def patched(name: str, value):
    """`worker.model.small_batch.<name>` is `value` for the engines built inside."""
    from worker.model import small_batch

    real = getattr(small_batch, name)
    setattr(small_batch, name, value)
    try:
        yield
    finally:
        setattr(small_batch, name, real)


def torch_gemm_only():
    """Engines built inside keep their `nn.Linear` layers (the baseline)."""
    return patched("install", lambda model: 0)


def kernel_only():
    """Engines built inside take the small-batch kernel but keep their weights unpacked."""
    return patched("_pack", lambda module, keep_plain: None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF checkpoint dir (the CPU benchmark model is made "
                                                               "if missing)")
    p.add_argument("--running", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=15, help="turns each step takes")
    p.add_argument("--iterations", type=int, default=10, help="steps timed per turn")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    path = ensure_model(Path(a.model))
    report: dict = {"machine": machine(), "model": str(path), "rounds": a.rounds, "iterations_per_round": a.iterations,
                    "torch_threads": torch.get_num_threads(), "by_running": {}}
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'running':>8}{'torch GEMM ms':>15}{'kernel ms':>11}{'default ms':>12}{'vs GEMM':>9}{'vs kernel':>11}"
          f"  vs kernel per round  greedy ids")
    for running in a.running:
        with torch_gemm_only():
            gemm, gemm_ids, _ = decode_step(path, running)
        with kernel_only():
            kernel, kernel_ids, _ = decode_step(path, running)
        default, ids, forward = decode_step(path, running)
        ms = interleaved_ms({"torch_gemm": gemm, "kernel": kernel, "default": default}, a.rounds, a.iterations)
        vs_gemm = [g / d for g, d in zip(ms["torch_gemm"], ms["default"])]
        vs_kernel = [k / d for k, d in zip(ms["kernel"], ms["default"])]
        same = gemm_ids == kernel_ids == ids
        row = {"decode_step_ms": ms, "speedup_vs_torch_gemm_per_round": vs_gemm,
               "speedup_vs_torch_gemm": statistics.median(vs_gemm), "speedup_vs_kernel_per_round": vs_kernel,
               "speedup_vs_kernel": statistics.median(vs_kernel), "greedy_ids_identical": same, "forward": forward}
        report["by_running"][str(running)] = row
        print(f"{running:>8}{statistics.median(ms['torch_gemm']):>15.2f}{statistics.median(ms['kernel']):>11.2f}"
              f"{statistics.median(ms['default']):>12.2f}{row['speedup_vs_torch_gemm']:>8.2f}x"
              f"{row['speedup_vs_kernel']:>10.2f}x  {min(vs_kernel):.2f}-{max(vs_kernel):.2f}x"
              f"{'':>10}{'identical' if same else 'differ'}")
    write_report(report, a.out, "bench_small_batch.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
