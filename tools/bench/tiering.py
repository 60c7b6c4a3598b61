"""Prompt-length tiering inside one engine (worker/engine/tiering.py): short prompts' TTFT
in a steady open-loop stream, alone, with long prompts among them, and with long prompts
under the per-step long-prefill cap, on the same engine settings and the same arrivals.

    python -m tools.bench.tiering [--model DIR] [--duration 3] [--out results]

Arrivals are fixed in wall-clock time (one request every `interval_s`, every
`long_every`-th of them long); TTFT is first token - scheduled arrival, in seconds (so
queueing behind a slow step counts; `--clock cpu`: on the engine thread's CPU time, see
`short_ttft_stream`). Writes `bench_tiering.json` and a plot; the table
gives p50 / p99 of the short prompts' TTFT, each mix's ratio to the short-only stream, and
the median over rounds of that ratio taken within each round (`compare`).
tests/engine/test_tiering.py asserts the bound of issue 28 on the tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from schemas.params import SamplingParams
from tools.bench.harness import percentile


def short_ttft_stream(engine, *, duration_s: float, interval_s: float, long_every: int | None, short_len: int = 16,
                      long_len: int = 900, short_out: int = 16, long_out: int = 4, vocab: int = 500,
                      seed: int = 0, drain_long: bool = True, clock: str = "wall") -> dict:
    """Run one open-loop stream through `engine` (an `Engine`) and return the short
    prompts' TTFTs (seconds) and the long ones'. `long_every`: every n-th arrival is a
    long prompt of `long_len` tokens (None: no long prompts). Prompts are random ids in
    [1, vocab); outputs ignore EOS so every request runs its `max_tokens`. TTFT: the
    clock after the step that returned a request's first token, minus its arrival.
    `drain_long=False`: once every short request has finished, the long ones still
    queued are aborted instead of run to the end (at the cap that backlog takes several
    seconds and no short request sees it; their TTFTs are then missing from "long").
    `clock`: "wall" (`time.time()`; the engine sleeps until the next arrival) or "cpu":
    a virtual clock that advances by the CPU time of this thread (`time.thread_time()`,
    where the engine computes with one intra-op thread) while the engine steps and jumps
    to the next arrival while it idles. On the cpu clock other processes and a virtual
    machine's steal time cost nothing: it is the stream a worker with its own core sees."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    on_cpu = clock == "cpu"
    rng = random.Random(seed)
    n = int(duration_s / interval_s)
    start = 0.0 if on_cpu else time.time() + 0.05
    arrivals = []
    for i in range(n):
        is_long = long_every is not None and i % long_every == long_every // 2
        length = long_len if is_long else short_len
        arrivals.append((start + i * interval_s, f"{'long' if is_long else 'short'}-{i}",
                         [rng.randrange(1, vocab) for _ in range(length)], long_out if is_long else short_out))
    ttft: dict[str, list[float]] = {"short": [], "long": []}
    waiting_first: dict[str, float] = {}  # request id -> arrival, until its first token
    num_short, short_done, aborted = sum(1 for a in arrivals if a[1].startswith("short")), 0, False
    virtual = 0.0  # the cpu clock

    def now() -> float:
        return virtual if on_cpu else time.time()

    nxt = 0
    while nxt < len(arrivals) or engine.has_unfinished():
        if not drain_long and not aborted and short_done == num_short:
            for _, rid, _, _ in arrivals:  # finished ones are ignored; the rest end at the next step
                engine.abort(rid)
            aborted = True
        t = now()
        while nxt < len(arrivals) and arrivals[nxt][0] <= t:
            at, rid, ids, max_tokens = arrivals[nxt]
            engine.add_request(rid, prompt_token_ids=ids, arrival_time=None if on_cpu else at,
                               params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
            waiting_first[rid] = at
            nxt += 1
        if not engine.has_unfinished():
            if on_cpu:
                virtual = arrivals[nxt][0]
            else:
                time.sleep(max(0.0, arrivals[nxt][0] - time.time()))
            continue
        c0 = time.thread_time()
        outs = engine.step()
        virtual += time.thread_time() - c0
        t = now()
        for out in outs:
            kind = out.request_id.split("-")[0]
            if out.new_token_ids and out.request_id in waiting_first:
                ttft[kind].append(t - waiting_first.pop(out.request_id))
            if out.finished:
                short_done += kind == "short"
    return ttft


@contextlib.contextmanager
def serving_gc():
    """The collector as a worker's engine process runs it (worker/engine/gc_tuning.py:
    heap frozen after start-up, young threshold raised), restored afterwards."""
    from worker.engine.gc_tuning import GEN0_THRESHOLD

    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def warm_up(engine, long_len: int, vocab: int = 500) -> None:
    """One short and one long request through `engine` (first calls of each code path)."""
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    engine.generate([[1 + i % (vocab - 1) for i in range(n)] for n in (16, long_len)], params)


def compare(make_engine: Callable[..., object], *, duration_s: float, interval_s: float, long_every: int,
            long_len: int, threshold: int, cap: int, repeats: int = 1,
            only: tuple[str, ...] = ("short_only", "long_mix_no_cap", "long_mix_cap"), drain_long: bool = True,
            clock: str = "wall") -> dict:
    """The three streams (short only; with long prompts, no cap; with long prompts and
    the cap; `only` picks some) on engines from `make_engine(**serving_tuning_overrides)`, each
    warmed up; `repeats` rounds, each running every mix once in turn, under the serving
    path's collector settings. Returns {mix: {p50_s, p99_s, num_short, ..., round_p99_s,
    round_p99_vs_short_only, median_round_p99_vs_short_only}}: p50/p99 over the TTFTs
    pooled across rounds, and a paired figure: each round's p99 over the same round's
    short-only p99 (the mixes of a round run back to back, seconds apart, so a slow
    moment of the machine that lasts a round, or a stall in one round, moves one pair
    and the median of the pairs stays; a pooled p99 over ~100 TTFTs a second is decided
    by one stall of a few hundred milliseconds). `drain_long`, `clock`: `short_ttft_stream`'s."""
    mixes = {"short_only": (None, {}), "long_mix_no_cap": (long_every, {}),
             "long_mix_cap": (long_every, {"long_prefill_threshold": threshold, "max_long_prefill_tokens": cap})}
    mixes = {k: v for k, v in mixes.items() if k in only}
    engines = {}
    for name, (_, over) in mixes.items():
        engines[name] = make_engine(**over)
        warm_up(engines[name], long_len)
    ttfts = {name: {"short": [], "long": []} for name in mixes}
    round_p99 = {name: [] for name in mixes}
    for r in range(repeats):  # rounds interleave the mixes: a slow moment of the machine hits them alike
        for name, (every, _) in mixes.items():
            with serving_gc():
                t = short_ttft_stream(engines[name], duration_s=duration_s, interval_s=interval_s, long_every=every,
                                      long_len=long_len, seed=r, drain_long=drain_long, clock=clock)
            for kind in ("short", "long"):
                ttfts[name][kind] += t[kind]
            round_p99[name].append(percentile(t["short"], 99))
    out = {}
    for name, t in ttfts.items():
        short, long = t["short"], t["long"]
        out[name] = {"num_short": len(short), "p50_s": statistics.median(short), "p99_s": percentile(short, 99),
                     "num_long": len(long), "long_p50_s": statistics.median(long) if long else None,
                     "round_p99_s": round_p99[name]}
    base = out["short_only"]
    for row in out.values():
        row["p99_vs_short_only"] = row["p99_s"] / base["p99_s"]
        row["round_p99_vs_short_only"] = [x / b for x, b in zip(row["round_p99_s"], base["round_p99_s"])]
        row["median_round_p99_vs_short_only"] = statistics.median(row["round_p99_vs_short_only"])
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from tests.conftest import tiny_checkpoint
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the tests' tiny Llama, made if missing)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of arrivals per stream")
    p.add_argument("--interval", type=float, default=0.004, help="seconds between arrivals")
    p.add_argument("--long-every", type=int, default=20, help="every n-th arrival is long")
    p.add_argument("--long-len", type=int, default=900, help="tokens of a long prompt")
    p.add_argument("--threshold", type=int, default=128, help="serving_tuning.long_prefill_threshold")
    p.add_argument("--cap", type=int, default=32, help="serving_tuning.max_long_prefill_tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or the engine thread's CPU time (short_ttft_stream)")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = a.model or str(tiny_checkpoint("llama"))

    def make(**over):
        tuning = ServingTuning(max_batched_tokens=2048, max_running_requests=64, **over)
        return Engine.from_pretrained(model, EngineConfig(model=ModelConfig(dtype="float32", device="cpu"),
                                                          serving_tuning=tuning))

    report = {"command": "python -m tools.bench.tiering " + " ".join(argv or []), "model": model,
              "settings": vars(a), "mixes": compare(make, duration_s=a.duration, interval_s=a.interval,
                                                    long_every=a.long_every, long_len=a.long_len,
                                                    threshold=a.threshold, cap=a.cap, repeats=a.repeats,
                                                    clock=a.clock)}
    print(f"{'mix':<18}{'short TTFT p50 ms':>18}{'p99 ms':>10}{'p99 / short only':>18}"
          f"{'median of rounds':>18}{'long TTFT p50 ms':>18}")
    for name, r in report["mixes"].items():
        lp = f"{r['long_p50_s'] * 1e3:.1f}" if r["long_p50_s"] is not None else "-"
        print(f"{name:<18}{r['p50_s'] * 1e3:>18.1f}{r['p99_s'] * 1e3:>10.1f}{r['p99_vs_short_only']:>18.2f}"
              f"{r['median_round_p99_vs_short_only']:>18.2f}{lp:>18}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_tiering.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "bench_tiering.png")
    print(f"wrote {out / 'bench_tiering.json'}")
    return 0


def _plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["mixes"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [report["mixes"][n]["p50_s"] * 1e3 for n in names], 0.4, label="p50")
    ax.bar([i + 0.2 for i in x], [report["mixes"][n]["p99_s"] * 1e3 for n in names], 0.4, label="p99")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("short prompts' TTFT (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    raise SystemExit(main())
