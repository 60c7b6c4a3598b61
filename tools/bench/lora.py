"""Multi-LoRA throughput: the engine alone, batches of requests decoding, with and
without adapters, side by side in one run (issue 30's goal: 8 adapters of rank 16 mixed
uniformly in a batch of 32 at >= 0.8x the base model alone; issue 50's: >= 0.85x).

    python -m tools.bench.lora                  # CPU: the bench model (hidden 256, 4 layers)
    python -m tools.bench.lora --device cuda    # GPU: the ~1.1B bench model, bf16

Modes, each its own engine decoding batches of `--batch` requests (`--prompt` tokens in,
`--max-tokens` out, ignore_eos; a new batch when one ends):
  base          an engine without LoRA (no hooks); "base, again" a second one: the noise floor
  lora, none    a LoRA engine, every request on the base model (the hooks' cost alone)
  lora, 1       a LoRA engine, every request on one adapter
  lora, 8 mixed a LoRA engine, the requests spread uniformly over `--adapters` adapters
  lora, 8 mixed, Python op   (with `--python-op`) the same through the operator
                written in Python (`inflight::lora_delta`) instead of the C++ one
                (`kernels.native`): the C++ operator's gain in the same run

The engines take turns, `--chunk` steps each, for `--rounds` rounds: every mode is
measured within the same second as the others, so a box whose speed drifts (another
process, a frequency change) moves them together. A turn's first step is not timed (it
brings its engine's weights back into the caches after the others' turns, which a server
running one engine never pays). A batch takes `--max-tokens` steps (its prefill, then a
decode per token after the first), 64 by default and no multiple of the default 9 steps
per turn: its prefill falls at every step of a turn in turn, timed 8 times in 9 as a
decode step is. Reported per mode: output tokens/s over its timed
steps (median of the rounds) and its ratio to the base engine's in the
same round (median of the rounds' ratios: the paired figure, steadier than a ratio of
medians). Also: each adapter's load time (disk to host memory, the loader thread) and
its size. Writes `bench_lora.json` and `bench_lora.png` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from unittest import mock


def main(argv: list[str] | None = None) -> int:
    import torch

    from schemas.params import SamplingParams
    from tools.bench.harness import DEFAULT_MODEL, GPU_MODEL, ensure_model, report_header, torch_dtype
    from tools.make_lora import make_adapter
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine
    from worker.model.kernels import native

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the bench model for the device)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=40, help="turns of every engine (each --chunk steps)")
    p.add_argument("--chunk", type=int, default=9, help="steps per turn (the first not timed; a number prime to a "
                                                      "batch's steps, so that its prefill falls at any step of a turn)")
    p.add_argument("--python-op", action="store_true",
                   help="add a mode: the mixed adapters through the Python operator instead of the C++ one")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    a.command_line = "python -m tools.bench.lora " + " ".join(argv or [])
    model = ensure_model(Path(a.model) if a.model else (GPU_MODEL if a.device == "cuda" else DEFAULT_MODEL))
    lora_dir = Path(".cache/bench-loras") / f"{model.name}-r{a.rank}"
    names = [f"ad{i}" for i in range(a.adapters)]
    for i, n in enumerate(names):
        if not (lora_dir / n / "adapter_model.safetensors").is_file():
            make_adapter(model, lora_dir / n, a.rank, seed=i + 1, std=0.05)
    dtype = str(torch_dtype(a.device)).removeprefix("torch.")

    def engine(lora: bool, python_op: bool = False) -> Engine:
        if python_op:  # the LoRA weights decide their operator when they are made: off for this engine
            with mock.patch.object(native, "available", lambda: False):
                return engine(lora)
        return Engine.from_pretrained(str(model), EngineConfig(
            model=ModelConfig(dtype=dtype, device=a.device, lora_dir=str(lora_dir) if lora else None,
                              max_loras=a.adapters, max_lora_rank=a.rank),
            serving_tuning=ServingTuning(max_running_requests=a.batch, max_batched_tokens=max(2048, a.batch * a.prompt),
                                         max_total_tokens=a.batch * (a.prompt + a.max_tokens) * 2)))

    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    counter = iter(range(10**9))

    def add_batch(eng: Engine, adapters: list[str | None]) -> None:
        for i in range(a.batch):
            prompt = [(i * 7919 + j * 31 + next(counter)) % 1000 + 1 for j in range(a.prompt)]
            eng.add_request(f"q{next(counter)}", prompt_token_ids=prompt, params=sp, adapter=adapters[i % len(adapters)])

    def turn(eng: Engine, adapters: list[str | None]) -> tuple[int, float]:
        """One turn: `--chunk` steps (a new batch first when the last one ended); the
        output tokens and seconds of its steps after the first."""
        tokens, seconds = 0, 0.0
        for k in range(a.chunk):
            if not eng.has_unfinished():
                add_batch(eng, adapters)
            t0 = time.perf_counter()
            n = sum(len(o.new_token_ids) for o in eng.step())
            if k > 0:
                tokens, seconds = tokens + n, seconds + time.perf_counter() - t0
        return tokens, seconds

    lora = {"none": engine(True), "1": engine(True), "mixed": engine(True)}
    modes = {"base": (engine(False), [None]), "base, again": (engine(False), [None]), "lora, none": (lora["none"], [None]),
             "lora, 1": (lora["1"], names[:1]), f"lora, {a.adapters} mixed": (lora["mixed"], names)}
    if a.python_op:
        modes[f"lora, {a.adapters} mixed, Python op"] = (engine(True, python_op=True), names)
    for eng, ads in modes.values():  # warm-up: every adapter loaded, kernels built, a batch through
        add_batch(eng, ads)
        while eng.has_unfinished():
            eng.step()
    tps: dict[str, list[float]] = {m: [] for m in modes}
    order = list(modes)
    for r in range(a.rounds):  # rotated order: no mode always runs right after the same one
        for m in order[r % len(order):] + order[:r % len(order)]:
            tokens, seconds = turn(*modes[m])
            tps[m].append(tokens / seconds if seconds else float("nan"))
    rounds = [i for i in range(a.rounds) if all(v[i] == v[i] for v in tps.values())]  # every mode timed
    paired = {m: statistics.median(tps[m][i] / tps["base"][i] for i in rounds) for m in modes}
    mixed = lora["mixed"]
    load_s = _load_times(mixed, names)
    weights = mixed.runner.lora
    report = {**report_header("lora", a, model, a.device), "settings": {k: v for k, v in vars(a).items()
                                                                        if k != "command_line"},
              "tokens_per_s": {m: statistics.median(tps[m][i] for i in rounds) for m in modes}, "rounds": tps,
              "vs_base": paired,
              "adapter": {"load_s_median": statistics.median(load_s), "load_s": load_s,
                          "params": mixed.scheduler.loras.resident[names[0]].num_params,
                          "slot_bytes": weights.nbytes // weights.max_loras}}
    if a.python_op:  # the C++ operator against the Python one, paired by round
        mixed_mode = f"lora, {a.adapters} mixed"
        report["cxx_vs_python_op"] = statistics.median(tps[mixed_mode][i] / tps[f"{mixed_mode}, Python op"][i]
                                                       for i in rounds)
    print(f"{len(rounds)} rounds of {a.chunk} steps per engine; tokens/s median of the rounds, vs base median of "
          "the rounds' ratios")
    print(f"{'mode':<32}{'output tok/s':>14}{'vs base':>10}")
    for m, v in report["tokens_per_s"].items():
        print(f"{m:<32}{v:>14.1f}{report['vs_base'][m]:>10.2f}")
    if a.python_op:
        print(f"mixed adapters, C++ operator vs Python operator (paired): {report['cxx_vs_python_op']:.3f}x")
    ad = report["adapter"]
    print(f"adapter load (disk -> host, median of {len(load_s)}): {ad['load_s_median'] * 1e3:.1f} ms; "
          f"{ad['params']} parameters; a slot holds {ad['slot_bytes'] / 2**20:.2f} MiB on the device")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_lora.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "bench_lora.png")
    print(f"wrote {out / 'bench_lora.json'}")
    return 0


def _load_times(eng, names: list[str]) -> list[float]:
    """Each adapter loaded again (evicting nothing: the slots are free after a reset)."""
    from worker.engine.lora_slots import LoRASlots

    old = eng.scheduler.loras
    slots = LoRASlots(len(names), None, old._load)
    times = []
    for n in names:
        slots.admit(n)
        slots.wait_loads()
        times.extend(slots.step_stats().load_s)
    slots.close()
    return times


def _plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["tokens_per_s"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(len(modes)), [report["tokens_per_s"][m] for m in modes])
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("output tokens / s")
    for i, m in enumerate(modes):
        ax.annotate(f"{report['vs_base'][m]:.2f}x", (i, report["tokens_per_s"][m]), ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    raise SystemExit(main())
