"""Speculative decoding (`serving_tuning.speculative`) vs plain decoding, in one run on one box.

The model is the trained benchmark checkpoint: the CPU benchmark Llama's shape trained
briefly on the standard library's docstrings (made on first use, ~3 minutes on 2 cores),
so its text reuses the words and phrases of its prompt and of itself as small language
models do. It was not trained to copy, and no CPU checkpoint we could train does at
length; the `copy` workload runs on the copy model instead (`tools/make_copy_model.py`,
written in seconds: an induction circuit in a 4-layer Llama of hidden 384, whose answers
are spans of its prompt, joined where the prompt repeats three tokens). Workloads, each
at `--running` requests at once, greedy:

  - prompt: a docstring passage of 100-200 tokens; the model writes on (new passages
    every round);
  - repeat: the same passages every round (agents and tools that send the same requests
    again: what suffix decoding's cache of finished requests is for);
  - copy: a passage, "Quote it:", and the passage's first 6 tokens; the copy model
    quotes on (an answer that repeats long spans of its prompt: edit this, extract that).

The configurations (plain decoding, then each of `--methods`) take turns over `--rounds`,
one batch each per round, on engines of their own (suffix decoding's cache emptied
between workloads). Reported per configuration: median TPOT (ms, per request: (last
token - first token) / (tokens - 1)), its ratio to plain decoding in the same round
(median over rounds), tokens accepted / proposed, and the mean accepted length (tokens
per speculating step, 1 + accepted / drafts). `--saturation N` adds a batch of N requests
(prompt workload, the default `disable_by_batch_size`): output tokens/s / plain's. Also
the rounds' whole wall time against plain decoding's (`wall_ratio_vs_off`). Writes
`bench_spec.json` and `bench_spec.png`.

    python -m tools.bench.spec --running 1 2 4 --methods ngram:2 ngram:4 ngram:8 suffix:4 --saturation 32
    python -m tools.bench.spec --running 1 2 4 --methods draft:2 draft:4   # a distilled 1-layer draft model
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from pathlib import Path

from tools.bench.harness import COPY_MODEL, TRAINED_MODEL, ensure_model, machine, write_report


@functools.cache
def _texts() -> list[str]:
    from tools.make_model import stdlib_docstrings

    return [t for t in stdlib_docstrings(400_000) if len(t) > 600]


def workloads(tokenizer, n: int, seed: int) -> dict[str, list[list[int]]]:
    """`n` prompts of each workload (token ids) for round `seed`, from docstrings the
    trained model was trained on (`repeat`: the same whatever the round; `copy`: for the
    copy model)."""
    texts = _texts()

    def passages(r: int) -> list[list[int]]:
        rng = random.Random(r)
        return [tokenizer.encode(t)[: rng.randrange(100, 201)] for t in rng.sample(texts, n)]

    quote = tokenizer.encode("\n\nQuote it:\n")
    return {"prompt": passages(1 + seed), "repeat": passages(0),
            "copy": [p + quote + p[:6] for p in passages(1 + seed)]}


def make_engine(path: Path, method: str, k: int, running: int, compile_mode: str, draft: Path | None = None,
                min_speedup: float | None = 1.0):
    from worker.config import EngineConfig, ModelConfig, ServingTuning, SpeculativeConfig
    from worker.engine import Engine

    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, min_speedup=min_speedup,
                             draft_model=str(draft) if method == "draft" else None)
    cfg = EngineConfig(model=ModelConfig(device="cpu", compile=compile_mode),
                       serving_tuning=ServingTuning(max_running_requests=max(running, 1), max_batched_tokens=4096,
                                                    max_total_tokens=max(running, 1) * 640, speculative=spec))
    return Engine.from_pretrained(str(path), cfg)


def run_batch(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run `prompts` at once to `max_tokens` each; per-request TPOT (ms), output tokens/s,
    and the proposer's counters over the batch."""
    from schemas.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    spec = engine.scheduler.speculation
    before = (spec.stats.num_drafts, spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens) if spec else None
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt_token_ids=p, params=params)
    first: dict[str, float] = {}
    count: dict[str, int] = {}
    tpot = []
    t0 = time.perf_counter()
    total = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
            total += len(o.new_token_ids)
            if o.finished and count[o.request_id] > 1:
                tpot.append((now - first[o.request_id]) * 1000 / (count[o.request_id] - 1))
    wall = time.perf_counter() - t0
    row = {"tpot_ms": statistics.median(tpot), "output_tokens_per_s": total / wall, "wall_s": wall}
    if spec:
        drafts = spec.stats.num_drafts - before[0]
        proposed = spec.stats.num_draft_tokens - before[1]
        accepted = spec.stats.num_accepted_tokens - before[2]
        row.update(drafts=drafts, proposed=proposed, accepted=accepted)
    return row


def compare(engines: dict, prompts, max_tokens: int, rounds: int) -> dict:
    """The configurations take turns, one batch each per round (`prompts(round)`); ratios
    to `off` per round."""
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(rounds):
        for name, engine in engines.items():
            runs[name].append(run_batch(engine, prompts(r), max_tokens))
    out = {}
    for name, rows in runs.items():
        r = {"tpot_ms": statistics.median(x["tpot_ms"] for x in rows),
             "output_tokens_per_s": statistics.median(x["output_tokens_per_s"] for x in rows),
             "tpot_ratio_vs_off": statistics.median(x["tpot_ms"] / b["tpot_ms"] for x, b in zip(rows, runs["off"])),
             "throughput_ratio_vs_off": statistics.median(x["output_tokens_per_s"] / b["output_tokens_per_s"]
                                                          for x, b in zip(rows, runs["off"])),
             # the rounds' whole wall time against plain decoding's (the same batches)
             "wall_ratio_vs_off": sum(x["wall_s"] for x in rows) / sum(b["wall_s"] for b in runs["off"])}
        if "drafts" in rows[0]:
            drafts, proposed, accepted = (sum(x[f] for x in rows) for f in ("drafts", "proposed", "accepted"))
            r.update(acceptance_rate=accepted / proposed if proposed else None,
                     mean_accepted_length=1 + accepted / drafts if drafts else None, drafts=drafts)
        out[name] = r
    return out


def engines_for(path: Path, methods: list[str], running: int, compile_mode: str, draft: Path | None,
                min_speedup: float | None) -> dict:
    """Plain decoding and one engine per `method:k`."""
    engines = {"off": make_engine(path, "off", 4, running, compile_mode)}
    for m in methods:
        method, _, k = m.partition(":")
        engines[m] = make_engine(path, method, int(k or 4), running, compile_mode, draft, min_speedup)
    return engines


def ensure_draft(path: Path, model: Path) -> Path:
    """The draft model at `path`, distilled from `model` if missing (tools/make_draft.py:
    1 layer, 400 steps, ~2 minutes on 2 cores)."""
    if not (path / "model.safetensors").is_file():
        from tools.make_draft import distill

        distill(model, path, layers=1, steps=400)
    return path


def empty_caches(engines: dict) -> None:
    """Suffix decoding forgets the finished requests of the workload before."""
    from worker.engine.suffix import SuffixCache

    for engine in engines.values():
        spec = engine.scheduler.speculation
        if spec is not None and spec.cache is not None:
            spec.cache = SuffixCache(spec.cache.max_requests, spec.cache.n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(TRAINED_MODEL), help="HF checkpoint dir (the trained benchmark model is "
                                                                "made if missing)")
    p.add_argument("--running", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--methods", nargs="+", default=["ngram:2", "ngram:4", "ngram:8", "suffix:4"],
                   help="method:num_speculative_tokens of each speculating engine")
    p.add_argument("--workloads", nargs="+", default=["prompt", "repeat"], choices=["prompt", "repeat", "copy"],
                   help="copy runs on the copy model (--copy-model), the others on --model")
    p.add_argument("--copy-model", default=str(COPY_MODEL), help="the copy workload's checkpoint (the copy model "
                                                                  "is made if missing)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--saturation", type=int, default=0, help="also N requests at once (0: skip)")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--draft-model", default=None, help="the draft of `draft:k` methods (default: a 1-layer draft "
                                                        "distilled from --model, made if missing)")
    p.add_argument("--min-speedup", default="1.0", help="speculative.min_speedup of the speculating engines "
                                                         "(`none`: guesses at every step, the step-cost rule off)")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    min_speedup = None if a.min_speedup.lower() == "none" else float(a.min_speedup)
    trained = any(w != "copy" for w in a.workloads) or a.saturation  # the copy workload alone needs no --model
    path = ensure_model(Path(a.model)) if trained else Path(a.model)
    drafting = any(m.startswith("draft") for m in a.methods)
    draft = ensure_draft(Path(a.draft_model or f"{path}-draft"), path) if drafting and trained else None
    report: dict = {"machine": machine(), "model": str(path), "draft_model": str(draft) if draft else None,
                    "compile": a.compile, "min_speedup": min_speedup, "rounds": a.rounds,
                    "max_tokens": a.max_tokens, "by_workload": {}}
    copy_path = ensure_model(Path(a.copy_model)) if "copy" in a.workloads else None
    if copy_path is not None:
        report["copy_model"] = str(copy_path)
    for running in a.running:
        by_model = {}
        for workload in a.workloads:
            model = copy_path if workload == "copy" else path
            if model not in by_model:
                model_draft = draft if model == path else ensure_draft(Path(f"{model}-draft"), model) if drafting else None
                by_model[model] = engines_for(model, a.methods, running, a.compile, model_draft, min_speedup)
            engines = by_model[model]
            tok = engines["off"].tokenizer
            empty_caches(engines)
            res = compare(engines, lambda r, w=workload, t=tok, n=running: workloads(t, n, r)[w], a.max_tokens,
                          a.rounds)
            report["by_workload"].setdefault(workload, {})[str(running)] = res
            _print(f"{workload} at {running} running", res)
    if a.saturation:
        n = a.saturation
        engines = engines_for(path, a.methods[:1] + a.methods[-1:], n, a.compile, draft, min_speedup)
        tok = engines["off"].tokenizer
        res = compare(engines, lambda r: workloads(tok, n, r)["prompt"], a.max_tokens, a.rounds)
        report["saturation"] = {str(n): res}
        _print(f"saturation: prompt at {n} running", res)
    out = write_report(report, a.out, "bench_spec.json")
    _plot(report, out.with_suffix(".png"))
    return 0


def _print(title: str, res: dict) -> None:
    print(title)
    for name, r in res.items():
        extra = (f"  accepted {r['acceptance_rate']:.2f} of proposed, {r['mean_accepted_length']:.2f} tokens/step"
                 if r.get("drafts") else "")
        print(f"  {name:<10} TPOT {r['tpot_ms']:7.2f} ms  {r['tpot_ratio_vs_off']:5.2f}x off  "
              f"{r['output_tokens_per_s']:7.1f} tok/s  wall {r['wall_ratio_vs_off']:5.2f}x off{extra}")


def _plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads_ = report["by_workload"]
    fig, axes = plt.subplots(1, len(workloads_), figsize=(5 * len(workloads_), 3.5), squeeze=False)
    for ax, (workload, by_running) in zip(axes[0], workloads_.items()):
        xs = [int(r) for r in by_running]
        for name in next(iter(by_running.values())):
            ax.plot(xs, [by_running[str(x)][name]["tpot_ratio_vs_off"] for x in xs], marker="o", label=name)
        ax.set_title(f"{workload}: TPOT vs plain decoding")
        ax.set_xlabel("requests running")
        ax.set_ylabel("TPOT ratio (lower is better)")
        ax.set_xticks(xs)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")


if __name__ == "__main__":
    raise SystemExit(main())
