"""Pipeline ceiling: how much of the engine's throughput one worker process delivers
when the device is fast, i.e. whether the I/O path (Kafka intake, claims, host work
around the step, event encoding, Redis, offsets, metrics, logs) limits a GPU.

The engine is the model-less `null_engine` over an emulated asynchronous device
(`null_engine(device_ms=D)`: a launched step is ready D ms later, a second launch queues
behind the first, waiting sleeps and releases the GIL as a CUDA sync does). For each row
(emulated device time per step x output length, 256 running requests):

  1. engine alone: the same jobs through `Engine.step()` in this process, all added at
     t=0 (tokens/s, jobs/s, host time per step = wall time / steps - device time, of
     which the engine core's own share — scheduling and bookkeeping, without input and
     output processing — from its StepStats);
  2. worker: the jobs are produced to fresh topics first, then one worker process is
     started on them (`python -m tools.bench.pipeline worker ...`, a real `Worker` on the
     dev stack's Kafka and Redis around the same null engine); the clock runs from the
     first event any job got to the last terminal event (Redis stream entry ids, ms);
     the worker's CPU seconds in that window are sampled with psutil.

Reported per row: tokens/s, jobs/s, worker / engine-alone ratios, the worker against the
device-bound limit (worker tokens/s over the engine alone's tokens/s divided by its device
busy ratio: what the engine would do were the device never idle), the worker process's
CPU seconds per 1k tokens and per 1k jobs. `--subscribers N` adds N pattern
subscribers that read every event live (reported, not part of the goal). Writes
results/bench_pipeline.json and a PNG, prints a table.

    tools/stack/devstack.sh up
    python -m tools.bench.pipeline                                    # default grid, ~5 min here
    python -m tools.bench.pipeline --device-ms 2 --output-lens 64 4   # the goal rows
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tools.bench.connections import add_connection_args, connection_sections, worker_sections
from worker.engine.core_proc import SpawnedCore

PROMPT_LEN = 32
BLOCK = 16


# ---- the engine under test ----------------------------------------------------------------
def tuning_dict(running: int, output_len: int, async_scheduling: bool = False) -> dict:
    """serving_tuning for a row: room for every running request's prompt + output."""
    per_req = -(-(PROMPT_LEN + output_len) // BLOCK) * BLOCK
    return dict(max_running_requests=running, max_total_tokens=running * per_req + BLOCK * 4,
                max_batched_tokens=max(4096, running), max_input_tokens=PROMPT_LEN,
                max_output_tokens=max(output_len, 16), kv_block_size=BLOCK, enable_prefix_caching=False,
                async_scheduling=async_scheduling)


def sleeping_engine(device_ms: float, tuning: dict):
    """A null engine (no model) over an emulated device of `device_ms` per step."""
    from worker.config import EngineConfig, ServingTuning
    from worker.model.null_runner import null_engine

    return null_engine(EngineConfig(serving_tuning=ServingTuning(**tuning)), vocab_size=32000,
                       max_model_len=PROMPT_LEN + tuning["max_output_tokens"] + 16, device_ms=device_ms)


@dataclass(frozen=True)
class SleepingEngineSpec(SpawnedCore):
    """`EngineSpec` of the sleeping null engine, for the worker's engine process."""

    device_ms: float
    tuning: dict

    def build_engine(self):
        return sleeping_engine(self.device_ms, self.tuning)

    def build_tokenizer(self):
        from worker.model.null_runner import LetterTokenizer

        return LetterTokenizer()


def prompt_ids(i: int) -> list[int]:
    return [(i * 131 + j * 7) % 31000 + 100 for j in range(PROMPT_LEN)]


def engine_alone(device_ms: float, output_len: int, num_jobs: int, running: int,
                 async_scheduling: bool = False) -> dict:
    from schemas.params import SamplingParams
    from worker.engine.gc_tuning import tune_gc

    eng = sleeping_engine(device_ms, tuning_dict(running, output_len, async_scheduling))
    tune_gc()  # as the worker's processes do after start-up
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    prompts = [prompt_ids(i) for i in range(num_jobs)]  # before the clock: the engine's work is adding them
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        eng.add_request(f"j{i}", prompt_token_ids=prompt, params=params)
    steps = tokens = jobs = 0
    core_host_s = 0.0
    while eng.has_unfinished():
        for out in eng.step():
            tokens += len(out.new_token_ids)
            jobs += out.finished
        steps += 1
        st = eng.last_step_stats
        core_host_s += st.duration_s - st.forward_s
    dt = time.perf_counter() - t0
    launch_s = eng.core.runner.launch_host_s  # asynchronous steps: the null runner's tokens, made in its launch
    return {"seconds": dt, "tokens": tokens, "jobs": jobs, "steps": steps, "tokens_per_s": tokens / dt,
            "jobs_per_s": jobs / dt, "host_ms_per_step": max(0.0, dt / steps * 1e3 - device_ms),
            "core_host_ms_per_step": core_host_s / steps * 1e3,
            "core_own_ms_per_step": (core_host_s - launch_s) / steps * 1e3,
            "device_busy_ratio": eng.last_step_stats.device_busy_s / dt if device_ms > 0 else None}


# ---- the worker process -----------------------------------------------------------------
def worker_main(a) -> int:
    """Entry of the worker subprocess: a Worker around the sleeping null engine (in its
    own engine process unless `worker.engine_process` is false in the config)."""
    from worker.config import load_config
    from worker.obs.log import setup_logging
    from worker.serve.worker import Worker

    setup_logging("WARNING")
    cfg = load_config(a.config)
    spec = SleepingEngineSpec(a.device_ms, json.loads(a.tuning))
    asyncio.run(Worker(cfg, engine_spec=spec).run())
    return 0


POLL_WINDOW = 64  # done marks checked per poll while the worker runs


class CpuSampler:
    """Samples the CPU seconds (user + system) of a process and its children (the engine
    process, the trace export process) every 20 ms with wall-clock times, so the CPU used
    inside any later-chosen window can be read off, in all and per process role (`front`:
    the worker's own process, `engine`, `export`, `other`). The process tree is re-read
    once a second only: listing children scans all of /proc, and the sampler shares the box
    with the worker."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.samples: list[tuple[float, float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def role(p, root) -> str:
        if p.pid == root.pid:
            return "front"
        cmd = " ".join(p.cmdline())
        return "engine" if "multiprocessing" in cmd else "export" if "trace_export" in cmd else "other"

    def _run(self) -> None:
        procs: list = [(self.proc, "front")]
        listed_at = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() - listed_at > 1.0:
                    procs = [(p, self.role(p, self.proc)) for p in [self.proc, *self.proc.children(recursive=True)]]
                    listed_at = time.monotonic()
                roles: dict[str, float] = {}
                for p, role in procs:
                    t = p.cpu_times()
                    roles[role] = roles.get(role, 0.0) + t.user + t.system
            except Exception:  # a process ended
                if not self.proc.is_running():
                    return
                continue
            self.samples.append((time.time(), sum(roles.values()), roles))
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _ends(self, t0: float, t1: float) -> tuple:
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        return before[-1] if before else self.samples[0], after[0] if after else self.samples[-1]

    def cpu_between(self, t0: float, t1: float) -> float:
        start, end = self._ends(t0, t1)
        return end[1] - start[1]

    def cpu_by_role(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds per process role between `t0` and `t1` (a process that started
        inside the window counts from 0)."""
        start, end = self._ends(t0, t1)
        return {role: cpu - start[2].get(role, 0.0) for role, cpu in end[2].items()}


async def produce(a, prefix: str, num_jobs: int, output_len: int) -> list[str]:
    from aiokafka import AIOKafkaProducer

    from schemas import keys
    from schemas.codec import encode
    from schemas.params import SamplingParams
    from schemas.wire import Job
    from worker.security.kafka import kafka_security_kwargs

    producer = AIOKafkaProducer(bootstrap_servers=a.kafka, linger_ms=5, acks=1, **kafka_security_kwargs(a.kafka_cfg))
    await producer.start()
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    ids = [f"{prefix}-{i}" for i in range(num_jobs)]
    try:
        futs = [await producer.send(keys.job_topic(prefix, "normal"),
                                    encode(Job(job_id=j, prompt_token_ids=prompt_ids(i), params=params)),
                                    key=j.encode()) for i, j in enumerate(ids)]
        await producer.flush()
        await asyncio.gather(*futs)
    finally:
        await producer.stop()
    return ids


async def subscribe(a, prefix: str, n: int, stop: asyncio.Event, counts: list[int]) -> None:
    from schemas import keys
    from worker.security.redis import redis_client

    async def one(k: int) -> None:
        r = redis_client(a.redis_cfg)
        ps = r.pubsub()
        await ps.psubscribe(keys.tenant_pattern(None, prefix))
        try:
            while not stop.is_set():
                msg = await ps.get_message(ignore_subscribe_messages=True, timeout=0.2)
                if msg is not None:
                    counts[k] += 1
        finally:
            await ps.aclose()
            await r.aclose()

    await asyncio.gather(*(one(k) for k in range(n)))


async def run_worker_row(a, device_ms: float, output_len: int, num_jobs: int, running: int, tmp: Path,
                         extra_cfg: dict | None = None, tree: Path | None = None) -> dict:
    """One worker row (see the module docstring). `extra_cfg`: config sections merged into
    the worker's (e.g. `tracing`); `tree`: run the worker from another checkout of the
    project (an A/B against older code; its own bench_pipeline serves the subprocess)."""
    import yaml

    from schemas import keys
    from worker.cli.topics import create_topics
    from worker.security.redis import redis_client

    prefix = f"pipe{uuid.uuid4().hex[:8]}"
    await create_topics(a.kafka, prefix, partitions=a.partitions, kafka=a.kafka_cfg)
    ids = await produce(a, prefix, num_jobs, output_len)
    tuning = tuning_dict(running, output_len, a.async_scheduling)
    kafka_section, redis_section, secret_env = worker_sections(a.kafka_cfg, a.redis_cfg)
    kafka_section.update(topic_prefix=prefix, group_id=f"{prefix}-workers", commit_interval_ms=200)
    redis_section.update(key_prefix=prefix, log_ttl_s=600)
    cfg = {
        "serving_tuning": tuning,
        "kafka": kafka_section,
        "redis": redis_section,
        "worker": {"worker_id": f"{prefix}-w", "engine_process": a.engine_process, "log_level": "WARNING"},
        "metrics": {"port": None},
        **(extra_cfg or {}),
    }
    cfg_path = tmp / f"{prefix}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log_path = Path(a.out) / "bench_pipeline_worker.log"
    counts = [0] * a.subscribers
    stop_subs = asyncio.Event()
    subs = asyncio.create_task(subscribe(a, prefix, a.subscribers, stop_subs, counts)) if a.subscribers else None
    if subs is not None:
        await asyncio.sleep(0.5)
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tools.bench.pipeline", "worker", "--config", str(cfg_path),
                                 "--device-ms", str(device_ms), "--tuning", json.dumps(tuning)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tree,
                                env={**os.environ, **secret_env, **({"PYTHONPATH": str(tree)} if tree else {})})
    sampler = CpuSampler(proc.pid)
    r = redis_client(a.redis_cfg)
    try:
        # Every job's done mark is checked, but only the oldest POLL_WINDOW unfinished ones
        # per poll (jobs finish roughly in order): asking for all 4k every 250 ms cost the
        # benchmark a good part of a core, taken from the worker on a 2-core box.
        remaining = list(ids)
        deadline = time.monotonic() + a.timeout
        while remaining:
            if proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(remaining)} of {num_jobs} jobs unfinished after {a.timeout} s")
            window = remaining[:POLL_WINDOW]
            pipe = r.pipeline(transaction=False)
            for j in window:
                pipe.exists(keys.done_key(j, prefix))
            pending = [j for j, done in zip(window, await pipe.execute()) if not done]
            remaining = pending + remaining[len(window):]
            if pending:
                await asyncio.sleep(0.25)
        sampler_window_end = time.time()
        pipe = r.pipeline(transaction=False)
        for j in ids:
            pipe.xrange(keys.log_key(j, prefix), count=1)
            pipe.xrevrange(keys.log_key(j, prefix), count=1)
        res = await pipe.execute()
        firsts = [int(x[0][0].split(b"-")[0]) for x in res[0::2]]
        lasts = [int(x[0][0].split(b"-")[0]) for x in res[1::2]]
        t0, t1 = min(firsts) / 1000, max(lasts) / 1000
        await asyncio.sleep(0.1)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        sampler.stop()
        stop_subs.set()
        if subs is not None:
            await subs
        await r.aclose()
    dt = max(t1 - t0, 1e-3)
    tokens = num_jobs * output_len
    cpu = sampler.cpu_between(t0, min(t1, sampler_window_end))
    out = {"seconds": dt, "tokens": tokens, "jobs": num_jobs, "tokens_per_s": tokens / dt,
           "jobs_per_s": num_jobs / dt, "cpu_s": cpu, "cpu_s_per_1k_tokens": cpu / tokens * 1000,
           "cpu_s_per_1k_jobs": cpu / num_jobs * 1000,
           "cpu_s_per_1k_jobs_by_process": {role: c / num_jobs * 1000 for role, c in sampler.cpu_by_role(
               t0, min(t1, sampler_window_end)).items()}}
    if a.subscribers:
        expected = num_jobs * (output_len + 2)  # at most: started + one event per token + finished
        out["subscribers"] = {"count": a.subscribers, "events_received": counts, "max_expected": expected}
    return out


def jobs_for(output_len: int, a) -> int:
    if a.jobs:
        return a.jobs
    return int(min(4096, max(2 * a.running, a.target_tokens // output_len)))


async def run_grid(a) -> list[dict]:
    import tempfile

    from tqdm import tqdm

    rows = []
    grid = [(d, n) for d in a.device_ms for n in a.output_lens]
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=len(grid), desc="rows", unit="row") as bar:
        for device_ms, output_len in grid:
            n = jobs_for(output_len, a)
            alone = engine_alone(device_ms, output_len, n, a.running, a.async_scheduling)
            other = engine_alone(device_ms, output_len, n, a.running, not a.async_scheduling)
            worker = await run_worker_row(a, device_ms, output_len, n, a.running, Path(tmp))
            seq, asy = (other, alone) if a.async_scheduling else (alone, other)
            busy = alone["device_busy_ratio"]
            rows.append({"device_ms": device_ms, "output_len": output_len, "prompt_len": PROMPT_LEN,
                         "num_jobs": n, "running": a.running, "async_scheduling": a.async_scheduling,
                         "engine_alone": alone, "engine_alone_sequential": seq, "engine_alone_async": asy,
                         "async_vs_sequential": asy["tokens_per_s"] / seq["tokens_per_s"], "worker": worker,
                         "ratio_tokens": worker["tokens_per_s"] / alone["tokens_per_s"],
                         "ratio_jobs": worker["jobs_per_s"] / alone["jobs_per_s"],
                         # the device-bound limit: what the engine alone would do with its device never idle
                         "worker_vs_device_limit": worker["tokens_per_s"] / alone["tokens_per_s"] * busy if busy
                         else None})
            bar.update(1)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'dev ms':>6}{'out':>5}{'jobs':>6}{'alone tok/s':>13}{'worker tok/s':>14}{'ratio':>7}"
          f"{'alone job/s':>13}{'worker job/s':>14}{'job ratio':>10}{'host ms/step':>14}{'core ms/step':>14}"
          f"{'cpu s/1k tok':>14}{'cpu s/1k job':>14}{'dev busy':>9}{'w/limit':>8}{'seq tok/s':>11}{'seq busy':>9}"
          f"{'async/seq':>10}")
    for r in rows:
        e, w = r["engine_alone"], r["worker"]
        print(f"{r['device_ms']:>6g}{r['output_len']:>5}{r['num_jobs']:>6}{e['tokens_per_s']:>13.0f}"
              f"{w['tokens_per_s']:>14.0f}{r['ratio_tokens']:>7.2f}{e['jobs_per_s']:>13.0f}{w['jobs_per_s']:>14.0f}"
              f"{r['ratio_jobs']:>10.2f}{e['host_ms_per_step']:>14.3f}{e['core_host_ms_per_step']:>14.3f}"
              f"{w['cpu_s_per_1k_tokens']:>14.4f}{w['cpu_s_per_1k_jobs']:>14.3f}"
              f"{e['device_busy_ratio'] or 0:>9.2f}{r['worker_vs_device_limit'] or 0:>8.2f}"
              f"{r['engine_alone_sequential']['tokens_per_s']:>11.0f}"
              f"{r['engine_alone_sequential']['device_busy_ratio'] or 0:>9.2f}{r['async_vs_sequential']:>10.2f}")


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = sorted({r["output_len"] for r in rows})
    devs = sorted({r["device_ms"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(lens))
    for k, n in enumerate(lens):
        ratios = [next((r["ratio_tokens"] for r in rows if r["device_ms"] == d and r["output_len"] == n), 0)
                  for d in devs]
        axes[0].bar([i + k * width for i in range(len(devs))], ratios, width, label=f"{n} output tokens")
        tps = [next((r["worker"]["tokens_per_s"] for r in rows if r["device_ms"] == d and r["output_len"] == n), 0)
               for d in devs]
        alone = [next((r["engine_alone"]["tokens_per_s"] for r in rows
                       if r["device_ms"] == d and r["output_len"] == n), 0) for d in devs]
        axes[1].plot(devs, tps, "o-", label=f"worker, {n} out")
        axes[1].plot(devs, alone, "x--", label=f"engine alone, {n} out")
    axes[0].axhline(0.9, color="gray", ls=":", label="goal 0.9x")
    axes[0].set_xticks([i + width * (len(lens) - 1) / 2 for i in range(len(devs))], [f"{d:g} ms" for d in devs])
    axes[0].set_xlabel("emulated device time per step")
    axes[0].set_ylabel("worker / engine alone (tokens/s)")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("emulated device time per step (ms)")
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle("Pipeline ceiling: one worker process vs the engine alone (null engine, 256 running)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help=argparse.SUPPRESS)
    w.add_argument("--config", required=True)
    w.add_argument("--device-ms", type=float, required=True)
    w.add_argument("--tuning", required=True)
    add_connection_args(p)
    p.add_argument("--device-ms", type=float, nargs="+", default=[0, 2, 5, 15])
    p.add_argument("--output-lens", type=int, nargs="+", default=[4, 64, 512])
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--jobs", type=int, default=None, help="jobs per row (default: ~128k tokens, 2x running to 4096)")
    p.add_argument("--target-tokens", type=int, default=131072)
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--subscribers", type=int, default=0)
    p.add_argument("--engine-thread", dest="engine_process", action="store_false",
                   help="step the engine in a thread of the worker process instead of its own process")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per worker row")
    p.add_argument("--sequential", dest="async_scheduling", action="store_false",
                   help="the worker and the engine-alone baseline with sequential steps (default: "
                        "serving_tuning.async_scheduling on; the engine alone also runs the other way)")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    if a.cmd == "worker":
        return worker_main(a)
    import logging

    from tools.bench.harness import machine

    logging.getLogger("aiokafka").setLevel(logging.ERROR)  # produce retries while new topics elect leaders

    a.kafka_cfg, a.redis_cfg = connection_sections(a)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    rows = asyncio.run(run_grid(a))
    report = {"mode": "pipeline", "command": "python -m tools.bench.pipeline " + " ".join(argv or sys.argv[1:]),
              "machine": machine(), "kafka": a.kafka, "redis": a.redis, "rows": rows}
    out = Path(a.out) / "bench_pipeline.json"
    out.write_text(json.dumps(report, indent=2))
    plot(rows, Path(a.out) / "bench_pipeline.png")
    print_table(rows)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
