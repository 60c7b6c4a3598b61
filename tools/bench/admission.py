"""Admission's cost per step behind a spent long-prefill cap (prompt-length tiering,
worker/engine/tiering.py): `Scheduler.schedule()` seconds per step with N long prompts
waiting while one short prompt arrives before each step, on the model-less NullRunner
(so the figure is the scheduler's own time, nothing of a forward). The same steps with no
long prompt waiting are the baseline; the ratio is what the waiting long prompts add.

Long prompts wait in their own heap in each tenant's queue (worker/engine/fair_share.py),
so once the step's cap is spent admission passes over all of them at once: the cost
should not grow with N. Run it before and after a change to the scheduler's queues.

    python -m tools.bench.admission                 # N = 0, 40, 200; 150 steps each
    python -m tools.bench.admission --waiting 0 1000 --steps 300

Writes results/bench_admission.json and results/bench_admission.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from schemas.params import SamplingParams
from tools.bench.harness import machine, write_report

WARM_UP_STEPS = 10


def schedule_ms_per_step(num_long: int, steps: int, repeats: int) -> dict:
    """Median over `repeats` runs of the mean `schedule()` milliseconds per step (after
    `WARM_UP_STEPS`), and the long-prefill deferrals counted (`num_capped_total`)."""
    from worker.config import EngineConfig, ServingTuning
    from worker.model.null_runner import null_engine

    runs, capped = [], 0
    for _ in range(repeats):
        tuning = ServingTuning(max_batched_tokens=256, max_running_requests=32, kv_block_size=16,
                               max_total_tokens=1 << 20, long_prefill_threshold=64, max_long_prefill_tokens=32)
        eng = null_engine(EngineConfig(serving_tuning=tuning), vocab_size=100, max_model_len=4096)
        long_params = SamplingParams(max_tokens=64, ignore_eos=True)
        short_params = SamplingParams(max_tokens=4, ignore_eos=True)
        for i in range(num_long):
            eng.add_request(f"long-{i}", prompt_token_ids=[1 + (i + j) % 90 for j in range(2000)], params=long_params)
        sched = eng.core.scheduler
        real, spent = sched.schedule, []

        def timed(*args, real=real, spent=spent, **kwargs):
            t0 = time.perf_counter()
            out = real(*args, **kwargs)
            spent.append(time.perf_counter() - t0)
            return out

        sched.schedule = timed
        for step in range(steps):
            eng.add_request(f"short-{step}", prompt_token_ids=[91 + (step + j) % 8 for j in range(8)],
                            params=short_params)
            eng.step()
        runs.append(1e3 * statistics.fmean(spent[WARM_UP_STEPS:]))
        capped = sched.long_prefills.num_capped_total
    return {"waiting_long": num_long, "schedule_ms_per_step": statistics.median(runs), "runs_ms": runs,
            "long_prefill_capped": capped}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--waiting", type=int, nargs="+", default=[0, 40, 200], help="long prompts waiting (0: baseline)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    rows = [schedule_ms_per_step(n, a.steps, a.repeats) for n in sorted(set([0, *a.waiting]))]
    base = rows[0]["schedule_ms_per_step"]
    for r in rows:
        r["vs_none_waiting"] = r["schedule_ms_per_step"] / base
    print(f"{'long prompts waiting':>22}{'schedule() ms/step':>20}{'vs none waiting':>17}")
    for r in rows:
        print(f"{r['waiting_long']:>22}{r['schedule_ms_per_step']:>20.3f}{r['vs_none_waiting']:>17.2f}")
    report = {"command": "python -m tools.bench.admission " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": machine(), "settings": vars(a), "rows": rows}
    write_report(report, a.out, "bench_admission.json")
    _plot(rows, Path(a.out) / "bench_admission.png")
    return 0


def _plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([str(r["waiting_long"]) for r in rows], [r["schedule_ms_per_step"] for r in rows])
    ax.set_xlabel("long prompts waiting behind a spent cap")
    ax.set_ylabel("schedule() ms per step")
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    raise SystemExit(main())
