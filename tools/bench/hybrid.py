"""Recurrent-state and hybrid models (`worker/model/recurrent.py`), ratios measured in one run.

  throughput  a Mamba-2 hybrid of the CPU benchmark model's shape (Bamba: hidden 256, four
              layers, Mamba-2 mixers in three and attention in the last; random init)
              through Inflight's engine vs transformers' `generate` in static batches of
              `--max-batch`: the same requests (`tools.bench.workloads`, all submitted at
              t=0, greedy, EOS ignored), output tokens/s, greedy agreement.
  context     one decode step of `--running` requests at 256 / 1024 / 4096 tokens of
              context: the hybrid beside a Llama of the same shape (attention in all four
              layers), steps timed in turns (`harness.interleaved_ms`). A recurrent
              layer's step does not read the context, an attention layer's does.

Writes JSON (and a PNG for `context`) under --out, prints a table.

    python -m tools.bench.hybrid throughput --num-requests 128
    python -m tools.bench.hybrid context --running 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from tools.bench.engine import agreement, run_hf_static, run_inflight
from tools.bench.harness import DEVICE_DEFAULTS, decode_step, interleaved_ms, machine, write_report
from tools.bench.workloads import make_workload

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4,
             head_dim=32, max_position_embeddings=8192, num_hidden_layers=4)
HYBRID = ("bamba", dict(SHAPE, attn_layer_indices=[3], mamba_n_heads=16, mamba_d_head=32, mamba_n_groups=1,
                        mamba_d_state=64, mamba_expand=2))
LLAMA = ("llama", SHAPE)
CONTEXTS = (256, 1024, 4096)


def checkpoint(kind: tuple[str, dict], out: Path) -> Path:
    """The random-init checkpoint of `kind` (made once, with the test models' tokenizer)."""
    from tests.conftest import tiny_checkpoint
    from tools.tiny_archs import make_tiny

    if not (out / "config.json").is_file():
        make_tiny(kind[0], out, tiny_checkpoint("llama"), kind[1])
    return out


def throughput(a) -> dict:
    path = checkpoint(HYBRID, Path(a.models) / "bench-bamba")
    work = make_workload("mixed", a.num_requests, vocab_size=SHAPE["vocab_size"], scale=a.scale, seed=0,
                         max_input=a.max_input, max_output=a.max_output, avoid_ids=frozenset({0}))
    total_out = sum(r.max_tokens for r in work)
    kv_tokens = a.max_batch * (a.max_input + a.max_output)
    runs = {
        "inflight": lambda p: run_inflight(path, work, a.max_batch, kv_tokens, a.budget, p, compile_mode="off"),
        "hf_static_batching": lambda p: run_hf_static(path, work, a.max_batch, p),
    }
    results, ids = {}, {}
    for name, run in runs.items():
        with tqdm(total=total_out, desc=name, unit="tok") as pbar:
            seconds, ids[name] = run(pbar)
        results[name] = {"seconds": seconds, "output_tokens_per_s": total_out / seconds}
    ratio = results["inflight"]["output_tokens_per_s"] / results["hf_static_batching"]["output_tokens_per_s"]
    report = {"mode": "throughput", "command": a.command_line, "machine": machine(), "model": HYBRID[0],
              "shape": HYBRID[1], "num_requests": len(work), "output_tokens": total_out, "max_batch": a.max_batch,
              "results": results, "inflight_vs_hf_static_batching": ratio,
              "greedy_agreement": agreement(ids["inflight"], ids["hf_static_batching"])}
    for name, r in results.items():
        print(f"{name:<22}{r['seconds']:>8.1f} s {r['output_tokens_per_s']:>9.1f} out tok/s")
    g = report["greedy_agreement"]
    print(f"inflight / generate (static batches of {a.max_batch}): {ratio:.2f}x; greedy ids identical on "
          f"{g['identical']}/{g['requests']} requests")
    return report


def context_curve(a) -> dict:
    models = {"hybrid (bamba)": checkpoint(HYBRID, Path(a.models) / "bench-bamba"),
              "attention (llama)": checkpoint(LLAMA, Path(a.models) / "bench-llama-8k")}
    rows = {}
    for context in CONTEXTS:
        steps = {name: decode_step(path, a.running, context, compile="off")[0] for name, path in models.items()}
        ms = interleaved_ms(steps, a.rounds, a.per_round)
        rows[context] = {name: statistics.median(v) for name, v in ms.items()}
        print(f"context {context:>5}: " + "  ".join(f"{n} {v:.2f} ms" for n, v in rows[context].items()))
    growth = {name: rows[CONTEXTS[-1]][name] / rows[CONTEXTS[0]][name] for name in models}
    print("step time at 4096 / at 256: " + "  ".join(f"{n} {g:.2f}x" for n, g in growth.items()))
    report = {"mode": "context", "command": a.command_line, "machine": machine(), "running": a.running,
              "models": {n: str(p) for n, p in models.items()}, "decode_step_ms": rows,
              "growth_4096_vs_256": growth}
    _plot(report, Path(a.out) / "bench_hybrid_context.png")
    return report


def _plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["decode_step_ms"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in next(iter(rows.values())):
        ax.plot(list(rows), [rows[c][name] for c in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context per request (tokens)")
    ax.set_ylabel(f"decode step, {report['running']} running (ms)")
    ax.legend()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results", help="folder for JSON and PNG results")
    p.add_argument("--models", default=".cache/models", help="where the benchmark checkpoints are made")
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--num-requests", type=int, default=128)
    cpu = DEVICE_DEFAULTS["cpu"]
    for name in ("max_batch", "budget", "max_input", "max_output", "scale"):
        t.add_argument(f"--{name.replace('_', '-')}", type=type(cpu[name]), default=cpu[name])
    c = sub.add_parser("context")
    c.add_argument("--running", type=int, default=8)
    c.add_argument("--rounds", type=int, default=5)
    c.add_argument("--per-round", type=int, default=5)
    a = p.parse_args(argv)
    a.command_line = " ".join(["python -m tools.bench.hybrid", *(argv if argv is not None else sys.argv[1:])])
    report = throughput(a) if a.mode == "throughput" else context_curve(a)
    write_report(report, a.out, f"bench_hybrid_{a.mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
