"""Multi-LoRA throughput: the engine alone, one batch of requests decoding, with and
without adapters, side by side in one run (issue 30's goal: 8 adapters of rank 16 mixed
uniformly in a batch of 32 at >= 0.8x the base model alone).

    python -m tools.bench.lora                  # CPU: the bench model (hidden 256, 4 layers)
    python -m tools.bench.lora --device cuda    # GPU: the ~1.1B bench model, bf16

Modes, each a fresh batch of `--batch` requests (`--prompt` tokens in, `--max-tokens`
out, ignore_eos), run `--repeats` times interleaved, median output tokens/s:
  base          an engine without LoRA (no hooks); "base, again" a second one: the noise floor
  lora, none    the LoRA engine, every request on the base model (the hooks' cost alone)
  lora, 1       every request on one adapter
  lora, 8 mixed the requests spread uniformly over `--adapters` adapters
Also: each adapter's load time (disk to host memory, the loader thread) and its size.
Writes `bench_lora.json` and `bench_lora.png` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import torch

    from schemas.params import SamplingParams
    from tools.bench.harness import DEFAULT_MODEL, GPU_MODEL, ensure_model, report_header, torch_dtype
    from tools.make_lora import make_adapter
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the bench model for the device)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
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

    def engine(lora: bool) -> Engine:
        return Engine.from_pretrained(str(model), EngineConfig(
            model=ModelConfig(dtype=dtype, device=a.device, lora_dir=str(lora_dir) if lora else None,
                              max_loras=a.adapters, max_lora_rank=a.rank),
            serving_tuning=ServingTuning(max_running_requests=a.batch, max_batched_tokens=max(2048, a.batch * a.prompt),
                                         max_total_tokens=a.batch * (a.prompt + a.max_tokens) * 2)))

    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    counter = iter(range(10**9))

    def run(eng: Engine, adapters: list[str | None]) -> float:
        for i in range(a.batch):
            prompt = [(i * 7919 + j * 31 + next(counter)) % 1000 + 1 for j in range(a.prompt)]
            eng.add_request(f"q{next(counter)}", prompt_token_ids=prompt, params=sp, adapter=adapters[i % len(adapters)])
        tokens, t0 = 0, time.perf_counter()
        while eng.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in eng.step())
        return tokens / (time.perf_counter() - t0)

    base, lora = engine(False), engine(True)
    modes = {"base": (base, [None]), "base, again": (engine(False), [None]), "lora, none": (lora, [None]),
             "lora, 1": (lora, names[:1]),
             f"lora, {a.adapters} mixed": (lora, names)}
    for eng, ads in modes.values():  # warm-up: every adapter loaded, kernels built
        run(eng, ads)
    tps: dict[str, list[float]] = {m: [] for m in modes}
    order = list(modes)
    for r in range(a.repeats):  # rotated order: no mode always runs first (a warm or a cold moment)
        for m in order[r % len(order):] + order[:r % len(order)]:
            tps[m].append(run(*modes[m]))
    load_s = _load_times(lora, names)
    weights = lora.runner.lora
    report = {**report_header("lora", a, model, a.device), "settings": {k: v for k, v in vars(a).items()
                                                                        if k != "command_line"},
              "tokens_per_s": {m: statistics.median(v) for m, v in tps.items()}, "runs": tps,
              "adapter": {"load_s_median": statistics.median(load_s), "load_s": load_s,
                          "params": lora.scheduler.loras.resident[names[0]].num_params,
                          "slot_bytes": weights.nbytes // weights.max_loras}}
    b = report["tokens_per_s"]["base"]
    report["vs_base"] = {m: v / b for m, v in report["tokens_per_s"].items()}
    print(f"{'mode':<18}{'output tok/s':>14}{'vs base':>10}")
    for m, v in report["tokens_per_s"].items():
        print(f"{m:<18}{v:>14.1f}{report['vs_base'][m]:>10.2f}")
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
