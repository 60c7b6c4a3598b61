"""What tracing costs a worker: the pipeline benchmark's worker row (`tools.bench.pipeline`:
one real worker on the dev stack's Kafka and Redis around the model-less engine over an
emulated device, every job produced before it starts) with tracing off, and on at 100%
sampling with the default protobuf encoding (`on`), with JSON (`on-json`,
`tracing.protocol: http/json`), at 10% sampling (`on-10%`) and exported from the worker's
own process instead of the trace export process (`on-thread`, `tracing.export: thread`),
in alternating rounds of one invocation. Spans go over OTLP/HTTP to a collector stand-in
in its own process that reads and discards them (`--endpoint` names a real collector
instead, e.g. tools/stack/jaeger.sh's, whose ingest then shares the box's cores with the
worker); the batch processor's queue (and the export process's) is raised to 65536 spans
(`OTEL_BSP_MAX_QUEUE_SIZE`) so every span is exported, not dropped. `--baseline PATH`
adds the off and on rows run from another checkout (`baseline`, `baseline-on`; e.g. a
`git worktree` of the commit before a change).

Reported per variant (median over rounds): tokens/s, jobs/s, worker CPU seconds (worker,
engine and export processes) per 1k jobs, in all and per process; the ratios on/off (goal
>= 0.95), on-json/off, on-10%/off, on-thread/off, off/baseline and baseline-on/baseline;
the worker CPU per traced job (µs, on minus off), in all and per process (the worker's own
process is the one whose GIL serves jobs). Writes results/bench_tracing.json and a PNG, prints a table.

    tools/stack/devstack.sh up
    python -m tools.bench.tracing                         # 2 ms device, 256 running, 64-token jobs, 3 rounds (~10 min)
    git worktree add /tmp/base <commit> && python -m tools.bench.tracing --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from tools.bench.connections import add_connection_args, connection_sections
from tools.bench.pipeline import jobs_for, run_worker_row

JAEGER_OTLP = f"http://127.0.0.1:{os.environ.get('INFLIGHT_DEV_JAEGER_OTLP_HTTP_PORT', '14318')}"


def variants(a) -> list[tuple[str, dict | None, Path | None]]:
    def on(protocol: str, ratio: float = 1.0, **more) -> dict:
        return {"tracing": {"enabled": True, "endpoint": a.endpoint, "sample_ratio": ratio, "protocol": protocol,
                            "service_name": "bench-tracing", **more}}

    out = [("off", {"tracing": {"enabled": False}}, None), ("on", on("http/protobuf"), None),
           ("on-json", on("http/json"), None), ("on-10%", on("http/protobuf", 0.1), None),
           ("on-thread", on("http/protobuf", export="thread"), None)]
    if a.baseline:
        tree = Path(a.baseline).resolve()
        out += [("baseline", None, tree), ("baseline-on", on("http/protobuf"), tree)]
    return out


async def run(a) -> dict:
    n = jobs_for(a.output_len, a)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, extra, tree in variants(a):
                row = await run_worker_row(a, a.device_ms, a.output_len, n, a.running, Path(tmp), extra, tree)
                runs.setdefault(name, []).append(row)
                print(f"round {r + 1}/{a.rounds} {name:8s} {row['tokens_per_s']:9.0f} tok/s "
                      f"{row['jobs_per_s']:7.1f} jobs/s {row['cpu_s_per_1k_jobs']:6.2f} CPU s/1k jobs", flush=True)
    med = {name: {k: statistics.median(x[k] for x in rows) for k in ("tokens_per_s", "jobs_per_s",
                                                                     "cpu_s_per_1k_jobs")}
           for name, rows in runs.items()}
    for name, rows in runs.items():  # where the CPU went: the worker's own process, the engine's, the export one
        med[name]["cpu_s_per_1k_jobs_by_process"] = {
            role: statistics.median(x["cpu_s_per_1k_jobs_by_process"].get(role, 0.0) for x in rows)
            for role in ("front", "engine", "export")}
    off = med["off"]
    summary = {"on_vs_off_tokens": med["on"]["tokens_per_s"] / off["tokens_per_s"],
               "cpu_us_per_traced_job": (med["on"]["cpu_s_per_1k_jobs"] - off["cpu_s_per_1k_jobs"]) * 1000,
               "json_vs_off_tokens": med["on-json"]["tokens_per_s"] / off["tokens_per_s"],
               "json_cpu_us_per_traced_job": (med["on-json"]["cpu_s_per_1k_jobs"] - off["cpu_s_per_1k_jobs"]) * 1000,
               "ratio_0.1_vs_off_tokens": med["on-10%"]["tokens_per_s"] / off["tokens_per_s"],
               "thread_vs_off_tokens": med["on-thread"]["tokens_per_s"] / off["tokens_per_s"]}
    for name in ("on", "on-json", "on-thread"):  # µs per traced job in each process (on minus off)
        by, base = med[name]["cpu_s_per_1k_jobs_by_process"], off["cpu_s_per_1k_jobs_by_process"]
        summary[f"{name}_cpu_us_per_traced_job_by_process"] = {role: (by[role] - base[role]) * 1000 for role in by}
    if "baseline" in med:
        summary["off_vs_baseline_tokens"] = med["off"]["tokens_per_s"] / med["baseline"]["tokens_per_s"]
        summary["baseline_on_vs_baseline_off_tokens"] = (med["baseline-on"]["tokens_per_s"]
                                                         / med["baseline"]["tokens_per_s"])
    return {"num_jobs": n, "runs": runs, "median": med, "summary": summary}


def plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "cpu_s_per_1k_jobs", "CPU s per 1k jobs")):
        for i, name in enumerate(names):
            vals = [r[key] for r in report["runs"][name]]
            ax.scatter([i] * len(vals), vals, color=f"C{i}")
            ax.bar(i, report["median"][name][key], alpha=0.3, color=f"C{i}")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(label)
    s = report["summary"]
    fig.suptitle(f"100% sampled: protobuf {s['on_vs_off_tokens']:.2f}x, json {s['json_vs_off_tokens']:.2f}x "
                 f"tokens/s of off; {s['cpu_us_per_traced_job']:.0f} / {s['json_cpu_us_per_traced_job']:.0f} µs CPU "
                 "per traced job", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def sink_main(port: int, record: str | None = None) -> int:
    """A collector stand-in that reads every OTLP/HTTP export and answers 200 without
    parsing it: the worker's own cost is measured, not a collector's sharing the box.
    `record`: a file each export's body is appended to, one per line (OTLP/JSON bodies:
    `tools.bench.first_token` reads them)."""
    from aiohttp import web

    out = open(record, "ab") if record else None  # noqa: SIM115 (open while the sink serves)

    async def accept(request: web.Request) -> web.Response:
        body = await request.read()
        if out is not None:
            out.write(body + b"\n")
            out.flush()
        return web.Response(status=200, content_type="application/json", text="{}")

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/v1/traces", accept)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
    return 0


@contextlib.contextmanager
def discard_sink(record: Path | None = None):
    """Run `sink_main` in its own process on a free port; yields its base address.
    `record`: as `sink_main`'s."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tools.bench.tracing", "sink", "--port", str(port),
                             *(["--record", str(record)] if record is not None else [])])
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sink"]:
        return sink_main(int(argv[argv.index("--port") + 1]),
                         argv[argv.index("--record") + 1] if "--record" in argv else None)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_args(p)
    p.add_argument("--device-ms", type=float, default=2.0)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--jobs", type=int, default=None, help="jobs per run (default: as bench_pipeline, 2048 here)")
    p.add_argument("--target-tokens", type=int, default=131072)
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--endpoint", default=None, help="OTLP/HTTP base address of a collector (e.g. Jaeger's, "
                   f"{JAEGER_OTLP}); default: a discarding stand-in in its own process")
    p.add_argument("--baseline", default=None, help="another checkout to run the same row from (A/B)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    a.subscribers, a.engine_process, a.async_scheduling = 0, True, True
    # a queue that never drops: the cost of exporting every span is what is measured
    # (the SDK's default, 2048 spans, drops most of them at this rate)
    os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "65536")
    a.kafka_cfg, a.redis_cfg = connection_sections(a)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    import logging

    from tools.bench.harness import machine

    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    if a.endpoint is None:
        with discard_sink() as a.endpoint:
            report = asyncio.run(run(a))
    else:
        report = asyncio.run(run(a))
    report.update(mode="tracing", command="python -m tools.bench.tracing " + " ".join(argv or sys.argv[1:]),
                  machine=machine(), device_ms=a.device_ms, output_len=a.output_len, running=a.running,
                  collector=a.endpoint)
    out = Path(a.out) / "bench_tracing.json"
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    for name, m in report["median"].items():
        print(f"{name:9s} {m['tokens_per_s']:9.0f} tok/s {m['jobs_per_s']:7.1f} jobs/s "
              f"{m['cpu_s_per_1k_jobs']:6.2f} CPU s/1k jobs")
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
