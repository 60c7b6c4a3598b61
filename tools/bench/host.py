"""Host work per step: what the engine core and the model runner spend on the host around
each step, this tree side by side with another revision in one run (issue 50's first
row: host ms per step at 256 running).

    python -m tools.bench.host                        # this tree alone
    python -m tools.bench.host --baseline HEAD~3      # and HEAD~3, interleaved round by round

`--baseline REV` checks REV out into a temporary git worktree and runs this same file's
measurements there in a subprocess (the worktree's `worker` and `tools` on its path), one
round of each tree after the other, `--rounds` times; medians are reported.

Measured, milliseconds per step:
  core      the engine core alone over the null runner (no device time; 256 running,
            32-token prompts; `tools.bench.pipeline.engine_alone`): its own host time per
            step (schedule, admission, update, finishing; the forward and output
            processing excluded), with 512-token jobs (decoding: one start and end in two
            steps), 64-token jobs (~4 a step) and 4-token jobs (64 a step), sequential and
            asynchronous steps. In the
            asynchronous rows the null runner's token making runs in the core's launch
            and counts (a real runner launches onto its own thread); the rows "launch
            excluded" take it out (trees whose null runner times its launch).
  busy      not milliseconds: the emulated device's busy ratio with 2 ms steps and
            asynchronous steps, engine alone (the goal rows of `tools.bench.pipeline`;
            output processing runs in the same thread here, in a worker it does not).
  inputs    `ModelRunner.build_metadata` packing one step (token ids, positions, slot
            mapping, block tables, sample rows; a kernel back end's metadata, so no dense
            masks; CPU tensors) for 256 decodes at 512 context, one 2048-token prefill
            chunk, and both at once: the host work a GPU step starts with.
Writes `bench_host.json` and `bench_host.png` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

CORE_CASES = [(512, 1024, False), (512, 1024, True), (64, 2048, False), (64, 2048, True), (4, 8192, False),
              (4, 8192, True)]


def _core() -> dict[str, float]:
    from tools.bench.pipeline import engine_alone

    out = {}
    for output_len, jobs, async_steps in CORE_CASES:
        r = engine_alone(0.0, output_len, jobs, 256, async_steps)
        out[f"core, {output_len}-token jobs, {'async' if async_steps else 'sequential'}"] = r["core_host_ms_per_step"]
        if async_steps and "core_own_ms_per_step" in r:  # a tree whose null runner times its launch
            out[f"core, {output_len}-token jobs, async, the null runner's launch excluded"] = r["core_own_ms_per_step"]
    for output_len, jobs in ((64, 2048), (4, 8192)):  # the goal rows of tools.bench.pipeline, engine alone
        r = engine_alone(2.0, output_len, jobs, 256, True)
        out[f"device busy (ratio), 2 ms device, {output_len}-token jobs, async"] = r["device_busy_ratio"]
    return out


def _inputs(repeats: int = 200) -> dict[str, float]:
    import torch

    from schemas.params import SamplingParams
    from worker.engine.outputs import ScheduledRequest, SchedulerOutput
    from worker.model.runner import ModelRunner

    bs = 16

    class KernelBackend:  # the Triton back end's flag: no reference-path groups and masks
        USES_DENSE_METADATA = False

    # what `ModelRunner.build_metadata` reads of its runner (older trees read less: --baseline)
    runner = types.SimpleNamespace(block_size=bs, device=torch.device("cpu"), backend=KernelBackend, kv_caches=[],
                                   attention_modules=None, kv_scales=None, state_pool=None)
    try:  # a tree with the persistent block table (worker/model/input_batch.py)
        from worker.model.input_batch import BlockTableBuffer
        runner.block_table_buffer = BlockTableBuffer()
    except ImportError:
        pass
    runner._dense_spans = types.MethodType(ModelRunner._dense_spans, runner)
    params = SamplingParams(temperature=0)

    def decodes(n: int, ctx: int) -> list[ScheduledRequest]:
        toks = list(range(ctx))
        return [ScheduledRequest(f"d{i}", toks[ctx - 1:], ctx - 1, list(range(i * 40, i * 40 + -(-ctx // bs))), True,
                                 params, toks) for i in range(n)]

    def prefill(n: int) -> list[ScheduledRequest]:
        toks = list(range(n))
        return [ScheduledRequest("p", toks, 0, list(range(20000, 20000 + -(-n // bs))), True, params, toks)]

    out = {}
    for name, reqs, nd in (("inputs, 256 decodes at 512 context", decodes(256, 512), 256),
                           ("inputs, one 2048-token prefill", prefill(2048), 0),
                           ("inputs, 256 decodes + a 1024-token prefill", decodes(256, 512) + prefill(1024), 256)):
        sched = SchedulerOutput(1, reqs, sum(len(s.token_ids) for s in reqs), nd)
        for _ in range(20):
            ModelRunner.build_metadata(runner, sched)
        t0 = time.perf_counter()
        for _ in range(repeats):
            ModelRunner.build_metadata(runner, sched)
        out[name] = (time.perf_counter() - t0) / repeats * 1e3
    return out


def measure() -> dict[str, float]:
    """One round of every case in this process (ms per step)."""
    return {**_core(), **_inputs()}


def _measure_in(tree: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure"], cwd=tree, env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None, help="a git revision to measure beside this tree")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="results")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one round, JSON on stdout
    a = p.parse_args(argv)
    if a.measure:
        print(json.dumps(measure()))
        return 0
    from tools.bench.harness import machine, write_report

    here = Path(__file__).resolve().parents[2]
    runs: dict[str, list[dict[str, float]]] = {"this tree": []}
    with tempfile.TemporaryDirectory(prefix="inflight-baseline-") as tmp:
        base = Path(tmp) / "tree"
        if a.baseline:
            subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", "-q", str(base), a.baseline],
                           check=True)
            runs[a.baseline] = []
        try:
            for r in range(a.rounds):
                if a.baseline:
                    runs[a.baseline].append(_measure_in(base))
                runs["this tree"].append(_measure_in(here))
                print(f"round {r + 1}/{a.rounds} done", flush=True)
        finally:
            if a.baseline:
                subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(base)], check=False)
    cases = list(runs["this tree"][0])
    medians = {tree: {c: statistics.median(run.get(c, float("nan")) for run in rs) for c in cases}
               for tree, rs in runs.items()}  # NaN: a case the other tree does not measure
    report = {"mode": "host", "command": "python -m tools.bench.host " + " ".join(argv or sys.argv[1:]),
              "machine": machine(), "unit": "ms per step", "rounds": runs, "median": medians}
    trees = list(runs)
    print(f"\n{'case':78s}" + "".join(f"{t:>14s}" for t in trees) + ("   this / baseline" if a.baseline else ""))
    for c in cases:
        row = f"{c:78s}" + "".join(f"{medians[t][c]:14.3f}" for t in trees)
        if a.baseline:
            row += f"   {medians['this tree'][c] / medians[a.baseline][c]:.2f}x"
        print(row)
    out = Path(a.out)
    write_report(report, out, "bench_host.json")
    _plot(medians, cases, out / "bench_host.png")
    return 0


def _plot(medians: dict[str, dict[str, float]], cases: list[str], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = list(medians)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(trees)
    for i, t in enumerate(trees):
        ax.barh([j + i * width for j in range(len(cases))], [medians[t][c] for c in cases], height=width, label=t)
    ax.set_yticks([j + width * (len(trees) - 1) / 2 for j in range(len(cases))], cases, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("host ms per step (median); device busy rows: ratio")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    raise SystemExit(main())
