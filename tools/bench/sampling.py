"""The sampler's Exp(1) noise on the CPU (`worker.model.sampler._exponential`: -log U) vs
torch's `exponential_`, measured in one run on one box:

  draw     `_draw` of `--rows` sampled rows (temperature 1) at each vocabulary size of
           `--vocab`, seeded rows (each its own generator) and unseeded, the two noises
           taking turns (`harness.interleaved_ms`); median milliseconds of the rounds.
  engine   one decode step of `--rows` sampled requests on the CPU bench model (vocabulary
           2048), two engines stepping in turn, one per noise; medians and the median of
           the per-step ratios.

Writes `bench_sampling.json` under --out and prints a table.

    python -m tools.bench.sampling
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tools.bench.harness import DEFAULT_MODEL, ensure_model, interleaved_ms, machine, write_report


def torch_exponential(out, generator=None):
    """torch's own Exp(1) draws: the baseline."""
    return out.exponential_(generator=generator)


def bench_draw(rows: int, vocabs: list[int]) -> dict:
    import torch

    from schemas.params import SamplingParams
    from worker.model import sampler

    class Row:  # what `_draw` reads of a scheduled request
        def __init__(self, generator):
            self.generator = generator

    ours = sampler._exponential
    out: dict = {}
    params = [SamplingParams(temperature=1.0)] * rows
    try:
        for vocab in vocabs:
            logits = torch.randn(rows, vocab)
            for seeded in (True, False):
                reqs = [Row(torch.Generator().manual_seed(i) if seeded else None) for i in range(rows)]

                def draw(noise, lg=logits, rq=reqs):
                    sampler._exponential = noise
                    sampler._draw(lg, rq, params)

                rounds = interleaved_ms({"exponential_": lambda: draw(torch_exponential), "-log U": lambda: draw(ours)},
                                        rounds=10, per_round=4 if vocab > 10_000 else 20)
                ms = {name: statistics.median(r) for name, r in rounds.items()}
                out[f"{vocab}, {'seeded' if seeded else 'unseeded'}"] = {**ms, "speedup": ms["exponential_"] / ms["-log U"]}
    finally:
        sampler._exponential = ours
    return out


def bench_engine(model: Path, rows: int, steps: int) -> dict:
    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine
    from worker.model import sampler

    ours = sampler._exponential
    noises = {"exponential_": torch_exponential, "-log U": ours}

    def engine() -> Engine:
        return Engine.from_pretrained(str(model), EngineConfig(model=ModelConfig(device="cpu"), serving_tuning=ServingTuning(
            max_running_requests=rows, max_batched_tokens=4096, max_total_tokens=rows * (32 + steps + 40))))

    engines = {name: engine() for name in noises}
    out: dict = {}
    counter = iter(range(10**9))
    try:
        for seeded in (True, False):
            for name, eng in engines.items():
                sampler._exponential = noises[name]
                for i in range(rows):
                    sp = SamplingParams(temperature=1.0, seed=i if seeded else None, max_tokens=steps + 20,
                                        ignore_eos=True)
                    eng.add_request(f"r{next(counter)}", prompt_token_ids=[(7 * i + j) % 1900 + 5 for j in range(32)],
                                    params=sp)
                eng.step()
                eng.step()
            times: dict[str, list[float]] = {name: [] for name in engines}
            for _ in range(steps):
                for name, eng in engines.items():
                    sampler._exponential = noises[name]
                    t0 = time.perf_counter()
                    eng.step()
                    times[name].append(time.perf_counter() - t0)
            for name, eng in engines.items():
                sampler._exponential = noises[name]
                while eng.has_unfinished():
                    eng.step()
            ratios = [a / b for a, b in zip(times["exponential_"], times["-log U"])]
            out["seeded" if seeded else "unseeded"] = {
                **{f"{name}_ms": statistics.median(t) * 1000 for name, t in times.items()},
                "speedup": statistics.median(ratios)}
    finally:
        sampler._exponential = ours
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64, help="sampled rows / running requests")
    p.add_argument("--vocab", type=int, nargs="+", default=[2048, 32000, 128256])
    p.add_argument("--steps", type=int, default=100, help="engine steps timed per noise")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    model = ensure_model(DEFAULT_MODEL)
    report = {"machine": machine(), "model": str(model), "rows": a.rows, "draw": bench_draw(a.rows, a.vocab),
              "engine": bench_engine(model, a.rows, a.steps)}
    print(f"_draw of {a.rows} sampled rows (ms)")
    for key, r in report["draw"].items():
        print(f"  vocab {key:<20} exponential_ {r['exponential_']:8.2f}   -log U {r['-log U']:8.2f}   {r['speedup']:.2f}x")
    print(f"engine step, {a.rows} sampled requests, {model.name} (ms)")
    for key, r in report["engine"].items():
        print(f"  {key:<10} exponential_ {r['exponential__ms']:7.2f}   -log U {r['-log U_ms']:7.2f}   {r['speedup']:.2f}x")
    write_report(report, a.out, "bench_sampling.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
