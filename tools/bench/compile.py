"""The compiled forward vs the eager one (`model.compile`), measured in one run on one box.

  decode    one decode step of `--running` requests (contexts of 64-192 tokens):
            `ModelRunner.execute` (packing, forward, sampling) on the same step, an
            eager and a compiled engine taking turns (`--rounds` of `--iterations`
            steps each); median milliseconds and the median of the per-round ratios.
            Greedy ids of the step compared.
  start-up  `Engine.from_pretrained` in a fresh process: eager; compiled with empty
            caches (a capture ahead of time where torch offers it, `model.precompile`);
            compiled again (the capture loaded); and `torch.compile` at every start
            (`model.precompile: false`), first and again (Inductor's cache warm).
            Seconds and the ratios to the eager start; the caches live in a temporary
            directory.

Offline throughput with and without compile is `tools.bench.engine throughput`
(`inflight` vs `inflight_eager`). Writes `bench_compile.json` under --out and prints a table.

    python -m tools.bench.compile --running 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench.harness import (
    DEFAULT_MODEL,
    decode_step,
    ensure_model,
    interleaved_ms,
    machine,
    write_report,
)

START_SCRIPT = """
import time, sys
t0 = time.perf_counter()
from worker.config import EngineConfig, ModelConfig
from worker.engine import Engine
e = Engine.from_pretrained(sys.argv[1], EngineConfig(model=ModelConfig(device="cpu", compile=sys.argv[2],
                                                                       precompile=sys.argv[3] == "1")))
print(time.perf_counter() - t0, e.compile_report.describe(), sep="\\t")
"""


def start_up(path: Path, mode: str, cache: Path, precompile: bool = True) -> tuple[float, str]:
    """Seconds to build the engine in a fresh process with its caches under `cache`, and
    how its forward runs."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", START_SCRIPT, str(path), mode, "1" if precompile else "0"],
                         capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
    seconds, forward = out.split("\t")
    return float(seconds), forward


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF checkpoint dir (the CPU benchmark model is made "
                                                               "if missing)")
    p.add_argument("--running", type=int, default=32, help="decoding requests in the timed step")
    p.add_argument("--rounds", type=int, default=20, help="turns each step takes")
    p.add_argument("--iterations", type=int, default=10, help="steps timed per turn")
    p.add_argument("--skip-start-up", action="store_true", help="only the decode step")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    path = ensure_model(Path(a.model))
    eager, eager_ids, _ = decode_step(path, a.running, compile="off")
    compiled, compiled_ids, forward = decode_step(path, a.running, compile="on")
    ms = interleaved_ms({"eager": eager, "compiled": compiled}, a.rounds, a.iterations)
    ratios = [e / c for e, c in zip(ms["eager"], ms["compiled"])]
    speedup = statistics.median(ratios)
    report = {"machine": machine(), "model": str(path), "running": a.running, "rounds": a.rounds,
              "iterations_per_round": a.iterations, "decode_step_ms": ms, "decode_speedup_per_round": ratios,
              "decode_speedup": speedup, "compiled_forward": forward, "greedy_ids_identical": eager_ids == compiled_ids}
    print(f"decode step at {a.running} running: eager {statistics.median(ms['eager']):.2f} ms, compiled "
          f"{statistics.median(ms['compiled']):.2f} ms (medians of {a.rounds} rounds); compiled / eager per round: "
          f"median {speedup:.2f}x, {min(ratios):.2f}-{max(ratios):.2f}x; {forward}; greedy ids identical: "
          f"{eager_ids == compiled_ids}")
    if not a.skip_start_up:
        with tempfile.TemporaryDirectory() as cache:
            start_up(path, "off", Path(cache))  # builds the C decode kernel, cached beside the others: untimed
            starts = {name: start_up(path, mode, Path(cache), precompile) for name, mode, precompile in
                      [("eager", "off", True), ("compiled", "on", True), ("compiled_again", "on", True),
                       ("torch_compile", "on", False), ("torch_compile_again", "on", False)]}
        base = starts["eager"][0]
        report["start_up_s"] = {k: v[0] for k, v in starts.items()}
        report["start_up_vs_eager"] = {k: v[0] / base for k, v in starts.items() if k != "eager"}
        for name, (seconds, how) in starts.items():
            print(f"start-up {name:<20}{seconds:7.1f} s  ({seconds / base:.2f}x eager; {how})")
    write_report(report, a.out, "bench_compile.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
