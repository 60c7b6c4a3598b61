"""A randomized soak of a worker fleet under faults, as an operator would run it: worker
processes (model-less engines over an emulated device, so the delivery path is what is
tested) on their own Kafka broker and Redis server (tools/stack/devstack.sh on other ports),
jobs of 150-400 tokens arriving at --rate per second, some cancelled, and a nemesis:
SIGSTOP of a worker past its leases (x2), kill -9 of a worker (x2, replaced as an
orchestrator would), a Redis outage, a broker outage of 55 s, and a Redis restart that
loses its data. Then every job is checked against the invariants the README promises
(`worker.client.audit`, the rules `inflight jobs audit` runs too), and the soak's own:

  missing_outcome     no record in the results topic
  log_mid_way         its log does not start at seq 0 (read from its first entry)
  seq_gap             seqs not consecutive
  terminals != 1      no terminal event, or two
  text_mismatch       token texts do not concatenate to finished.text
  attempt_backwards   attempts decrease along the log
  log_vs_results      the log's terminal event differs from the recorded outcome
  cancel_ignored      the cancel was acknowledged before the job started, yet it streamed
  worker_traceback    a worker process logged a traceback (every stop must be one line)

With --cluster the stack is tools/stack/cluster.sh's (three KRaft nodes, replication factor
3, min.insync.replicas 2; a Redis master, a replica and three Sentinels) on free ports, the
nemesis runs its faults (leader, coordinator and controller kills, a rolling restart, a
paused broker, a Sentinel failover) in rounds with the worker faults, and the jobs are a
mix: short and long, all priorities, bursts of one flooding tenant, and a few jobs naming a
LoRA adapter or asking for structured output (the soak's engine is model-less: those take
their rejection path, exactly once like every outcome).

Logs of jobs finished more than two minutes before the data loss are gone from Redis by
design (their outcome is in the results topic): counted as `log_expired`, not a defect.
Writes soak.json (and the workers' logs) under --out (results/) and prints the defects by kind.

    python -m tools.soak --minutes 10                    # the README's figures
    python -m tools.soak --cluster --minutes 30          # three brokers, Redis behind Sentinel,
                                                         # the cluster faults (tools/soak_faults.py)
    python -m tools.soak worker --config C --device-ms 10  # one worker (used by the soak)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tools.stack.own_stack import ROOT, OwnStack


class Fleet:
    """Worker processes; a killed or exited one is replaced (a new worker id)."""

    def __init__(self, config: Path, logs: Path, device_ms: float) -> None:
        self.config, self.logs, self.device_ms = config, logs, device_ms
        self.procs: dict[str, subprocess.Popen] = {}
        self.num_started = 0
        self.exits: list[tuple[str, int | None]] = []

    def spawn(self) -> str:
        self.num_started += 1
        wid = f"soak-w{self.num_started}"
        with open(self.logs / f"{wid}.log", "w") as err:
            self.procs[wid] = subprocess.Popen(
                [sys.executable, "-m", "tools.soak", "worker", "--config", str(self.config), "--worker-id", wid,
                 "--device-ms", str(self.device_ms)], stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
        return wid

    def live(self) -> list[str]:
        return [w for w, p in self.procs.items() if p.poll() is None]

    def reap(self) -> None:
        """Replace workers that exited on their own (as an orchestrator restarts them)."""
        for wid, p in list(self.procs.items()):
            if p.poll() is not None:
                self.exits.append((wid, p.returncode))
                del self.procs[wid]
                self.spawn()

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


WORKER_FAULTS = ["sigstop", "kill9", "redis_outage", "broker_outage", "redis_lost", "sigstop", "kill9"]


def nemesis_plan(minutes: float, rng: random.Random, cluster: bool = False) -> list[tuple[float, str]]:
    """(seconds from start, fault) for every fault, spread over the run in random order.
    With `cluster`: rounds of every cluster fault and the two worker faults, one round per
    7.5 minutes (at least one), each round shuffled."""
    if cluster:
        from tools.soak_faults import CLUSTER_FAULTS

        faults = []
        for _ in range(max(1, int(minutes // 7.5))):
            one = [*CLUSTER_FAULTS, "sigstop", "kill9"]
            rng.shuffle(one)
            faults += one
    else:
        faults = list(WORKER_FAULTS)
        rng.shuffle(faults)
    span = minutes * 60
    slot = span * 0.85 / len(faults)
    return [(span * 0.08 + i * slot + rng.uniform(0, slot * 0.3), f) for i, f in enumerate(faults)]


async def run_soak(a) -> dict:
    from schemas.wire import Started, Token
    from worker.cli.topics import create_topics
    from worker.client import InflightClient
    from worker.client.audit import log_defects
    from worker.config import (
        KafkaConfig,
        MetricsConfig,
        RedisConfig,
        ServingTuning,
        WorkerConfig,
        WorkerSettings,
    )

    rng = random.Random(a.seed)
    run_dir = Path(a.out) / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    if a.cluster:
        from tools.soak_faults import ClusterNemesis
        from tools.stack.cluster_stack import ClusterStack

        stack = ClusterStack(ROOT / ".cache" / f"soak-cluster-{uuid.uuid4().hex[:6]}")
    else:
        stack = OwnStack(ROOT / ".cache" / f"soak-{uuid.uuid4().hex[:6]}")
    stack.up()
    prefix = "soak"
    bootstrap, redis_url = stack.bootstrap, stack.redis_url
    await create_topics(bootstrap, prefix, partitions=6, replication_factor=3 if a.cluster else 1)
    cfg = WorkerConfig(
        serving_tuning=ServingTuning(max_running_requests=16, max_total_tokens=16384, max_output_tokens=1024),
        kafka=KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, session_timeout_ms=10_000),
        redis=RedisConfig(url=redis_url, key_prefix=prefix, claim_lease_ms=5000),
        worker=WorkerSettings(max_local_jobs=24, drain_timeout_s=10.0), metrics=MetricsConfig(port=None))
    import msgspec
    import yaml

    config = run_dir / "worker.yaml"
    config.write_text(yaml.safe_dump(msgspec.to_builtins(cfg)))
    fleet = Fleet(config, run_dir, a.device_ms)
    for _ in range(a.workers):
        fleet.spawn()
    await asyncio.sleep(8)
    jobs: dict[str, dict] = {}
    cancels: dict[str, float] = {}
    faults: list[dict] = []
    t_start = time.monotonic()
    span = a.minutes * 60
    plan = nemesis_plan(a.minutes, rng, a.cluster)
    cluster_nemesis = ClusterNemesis(stack, prefix, cfg.kafka.group_id, rng) if a.cluster else None
    tenants: dict[str, str] = {}

    async with InflightClient(bootstrap, redis_url, topic_prefix=prefix, key_prefix=prefix) as client:
        async def produce():
            """Jobs at --rate per second, each submit its own task (as many producers would:
            one submit stuck on a paused broker does not hold the rest back), 64 at most."""
            i = 0
            in_flight = asyncio.Semaphore(64)
            pending: set[asyncio.Task] = set()
            while time.monotonic() - t_start < span:
                burst = a.cluster and rng.random() < 0.004  # a tenant floods: 40 jobs at once
                for _ in range(40 if burst else 1):
                    jid = f"j{i:05d}"
                    i += 1
                    spec = job_spec(rng, a.cluster, "flood" if burst else None)
                    cancel_after = rng.uniform(0, 3) if rng.random() < 0.05 else None
                    await in_flight.acquire()
                    task = asyncio.create_task(submit(jid, spec, cancel_after, in_flight))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                await asyncio.sleep(rng.expovariate(a.rate))
            await asyncio.gather(*pending)

        async def submit(jid: str, spec: dict, cancel_after: float | None, in_flight: asyncio.Semaphore):
            t, wall = time.monotonic() - t_start, time.time()  # the record's timestamp is taken now
            try:
                await client.submit(f"soak job {jid}", job_id=jid, **spec)
                jobs[jid] = {"tokens": spec["params"].max_tokens, "submitted": wall, "t": t}
                if spec.get("tenant"):
                    tenants[jid] = spec["tenant"]
            except Exception as e:  # the broker is away: the producer's user would retry later
                faults.append({"t": round(t, 1), "note": f"submit failed: {e!r}"[:200]})
                return
            finally:
                in_flight.release()
            if cancel_after is not None:
                await cancel_later(jid, cancel_after)

        async def cancel_later(jid: str, after_s: float):
            await asyncio.sleep(after_s)
            try:
                await client.cancel(jid)
                cancels[jid] = time.time()
            except Exception as e:
                faults.append({"t": round(time.monotonic() - t_start, 1), "note": f"cancel failed: {e!r}"[:200]})

        async def nemesis():
            for at, fault in plan:
                await asyncio.sleep(max(0.0, at - (time.monotonic() - t_start)))
                t = round(time.monotonic() - t_start, 1)
                live = fleet.live()
                if fault == "sigstop" and live:
                    wid = rng.choice(live)
                    fleet.procs[wid].send_signal(signal.SIGSTOP)
                    pause = rng.uniform(12, 20)  # past the 5 s leases and the 10 s session
                    await asyncio.sleep(pause)
                    fleet.procs[wid].send_signal(signal.SIGCONT)
                    faults.append({"t": t, "fault": fault, "worker": wid, "s": round(pause, 1)})
                elif fault == "kill9" and live:
                    wid = rng.choice(live)
                    fleet.procs[wid].kill()
                    faults.append({"t": t, "fault": fault, "worker": wid})
                elif fault == "redis_outage":
                    pid = stack.pid("redis")
                    os.kill(pid, signal.SIGSTOP)
                    await asyncio.sleep(10)
                    os.kill(pid, signal.SIGCONT)
                    faults.append({"t": t, "fault": fault, "s": 10})
                elif fault == "broker_outage":
                    stack.stop_kafka()
                    await asyncio.sleep(55)
                    stack.up()
                    faults.append({"t": t, "fault": fault, "s": 55})
                elif fault == "redis_lost":
                    stack.redis_cli("SHUTDOWN", "NOSAVE")
                    await asyncio.sleep(5)
                    stack.up()
                    faults.append({"t": t, "fault": fault, "s": 5})
                elif cluster_nemesis is not None:
                    info = await cluster_nemesis.run(fault)
                    w0, w1 = info.pop("window")
                    faults.append({"t": t, "fault": fault, "s": round(w1 - w0, 1), **info,
                                   "window": (round(w0 - t_start, 1), round(w1 - t_start, 1))})

        async def supervise():
            while time.monotonic() - t_start < span + 600:
                fleet.reap()
                await asyncio.sleep(1)

        sup = asyncio.create_task(supervise())
        await asyncio.gather(produce(), nemesis())
        deadline = time.monotonic() + a.settle_s
        found: dict = {}
        while time.monotonic() < deadline:
            found = await client.lookup_results(list(jobs), timeout_s=60)
            if len(found) == len(jobs):
                break
            await asyncio.sleep(5)
        sup.cancel()
        logs = {j: await client.read_log(j, tenant=tenants.get(j)) for j in jobs}
    fleet.stop_all()
    stack.down()

    defects: dict[str, list[str]] = {k: [] for k in (
        "missing_outcome", "log_mid_way", "seq_gap", "terminals_not_1", "text_mismatch", "attempt_backwards",
        "log_vs_results", "cancel_ignored")}
    log_expired = 0
    reasons: dict[str, int] = {}
    restarted = 0
    for jid, meta in jobs.items():
        rec = found.get(jid)
        log = logs[jid]
        if rec is None:
            defects["missing_outcome"].append(jid)
            continue
        reasons[rec.finish_reason.value] = reasons.get(rec.finish_reason.value, 0) + 1
        restarted += rec.attempt > 1
        if not log:
            log_expired += 1
            continue
        for kind in log_defects(log, rec):  # the invariants `inflight jobs audit` checks too
            defects[kind].append(jid)
        if jid in cancels:
            starts = [e for e in log if isinstance(e, Started)]
            streamed = any(isinstance(e, Token) for e in log if e.attempt == rec.attempt)
            if starts and streamed and cancels[jid] + 2.0 < meta["submitted"] + starts[-1].queue_time_s:
                defects["cancel_ignored"].append(jid)
        starts = [e for e in log if isinstance(e, Started) and e.queue_time_s is not None]
        if starts:  # when its last attempt started, in soak seconds
            meta["started_t"] = meta["t"] + starts[-1].queue_time_s
    tracebacks = sorted(f.name for f in run_dir.glob("soak-w*.log") if "Traceback" in f.read_text())
    defects["worker_traceback"] = tracebacks
    report = {
        "command": " ".join(sys.argv), "minutes": a.minutes, "workers": a.workers, "rate_per_s": a.rate,
        "device_ms": a.device_ms, "seed": a.seed, "jobs": len(jobs), "cancelled_sent": len(cancels),
        "finish_reasons": reasons, "restarted_jobs": restarted, "log_expired": log_expired,
        "faults": faults, "worker_exits": fleet.exits, "workers_started": fleet.num_started,
        "defects": {k: len(v) for k, v in defects.items()}, "defect_jobs": {k: v[:20] for k, v in defects.items() if v},
        "defect_logs": {j: _summary(logs.get(j, []), found.get(j))
                        for j in sorted({j for v in defects.values() for j in v})[:10]},
        "worker_logs": str(run_dir),
        "fault_effects": fault_effects(jobs, faults, span),
    }
    return report


def fault_effects(jobs: dict[str, dict], faults: list[dict], span: float) -> list[dict]:
    """Per fault with a window: jobs started per second inside it over the rate outside
    every fault window (the same offered load), and the longest wait from the fault's
    start (or a later submit) to a job's start, over the jobs submitted while it lasted."""
    windows = [f for f in faults if "window" in f]
    starts = sorted(m["started_t"] for m in jobs.values() if "started_t" in m and m["started_t"] <= span)
    inside = [(w0, w1) for f in windows for w0, w1 in [f["window"]]]
    quiet_s = span - sum(w1 - w0 for w0, w1 in inside)
    quiet = sum(1 for t in starts if not any(w0 <= t <= w1 for w0, w1 in inside))
    steady = quiet / quiet_s if quiet_s > 0 else 0.0
    out = []
    for f in windows:
        w0, w1 = f["window"]
        rate = sum(1 for t in starts if w0 <= t <= w1) / max(w1 - w0, 1e-9)
        waits = [m["started_t"] - max(m["t"], w0) for m in jobs.values()
                 if "started_t" in m and w0 <= m["t"] <= w1]
        out.append({"fault": f["fault"], "window": f["window"], "starts_per_s": round(rate, 2),
                    "vs_steady": round(rate / steady, 2) if steady else None,
                    "max_wait_to_start_s": round(max(waits), 1) if waits else None})
    return out


def job_spec(rng: random.Random, mix: bool, tenant: str | None = None) -> dict:
    """`InflightClient.submit` arguments of one soak job. Without `mix`: 150-400 tokens,
    normal priority (the README's figures). With it: 70% short (8-48 tokens), all three
    priorities, a tenant on a quarter, and 1% each naming a LoRA adapter or asking for
    JSON output."""
    from schemas.params import JsonObjectOutput, SamplingParams

    if not mix:
        return {"params": SamplingParams(max_tokens=rng.randint(150, 400), ignore_eos=True)}
    n = rng.randint(8, 48) if rng.random() < 0.7 else rng.randint(150, 400)
    spec: dict = {"priority": rng.choices(["high", "normal", "low"], [0.2, 0.6, 0.2])[0],
                  "tenant": tenant or (rng.choice(["acme", "globex"]) if rng.random() < 0.25 else None)}
    r = rng.random()
    if r < 0.01:
        spec["adapter"] = "soak-lora"
    structured = JsonObjectOutput() if 0.01 <= r < 0.02 else None
    spec["params"] = SamplingParams(max_tokens=n, ignore_eos=True, structured=structured)
    return spec


def _summary(log: list, recorded) -> dict:
    """A defect job's log, run-length coded by (event kind, attempt), and its recorded outcome."""
    runs: list[list] = []
    for e in log:
        kind = type(e).__name__
        if runs and runs[-1][0] == kind and runs[-1][1] == e.attempt:
            runs[-1][3] = e.seq
        else:
            runs.append([kind, e.attempt, e.seq, e.seq])
    rec = None if recorded is None else {"seq": recorded.seq, "attempt": recorded.attempt,
                                         "finish_reason": recorded.finish_reason.value}
    return {"log": runs, "recorded": rec}


def soak_worker(a) -> int:
    """One worker process of the soak: the real Worker around a model-less engine."""
    from worker.cli.commands import run_reported
    from worker.config import EngineConfig, load_config
    from worker.model.null_runner import null_engine
    from worker.obs.log import setup_logging
    from worker.serve.worker import Worker

    cfg = load_config(a.config)
    cfg.worker.worker_id = a.worker_id
    setup_logging("INFO", transient_grace_s=cfg.kafka.transient_grace_s)
    engine = null_engine(EngineConfig(serving_tuning=cfg.serving_tuning), vocab_size=1000, device_ms=a.device_ms)
    return run_reported(Worker(cfg, engine=engine).run(), bad_input="config error", kafka=cfg.kafka,
                        redis=cfg.redis, log_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        p = argparse.ArgumentParser(prog="tools.soak worker")
        p.add_argument("worker")
        p.add_argument("--config", required=True)
        p.add_argument("--worker-id", required=True)
        p.add_argument("--device-ms", type=float, default=10.0)
        sys.exit(soak_worker(p.parse_args()))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rate", type=float, default=1.5, help="jobs per second (Poisson)")
    p.add_argument("--device-ms", type=float, default=10.0, help="emulated device time per step")
    p.add_argument("--seed", type=int, default=25)
    p.add_argument("--settle-s", type=float, default=420.0, help="how long to wait for the last outcomes")
    p.add_argument("--out", default="results")
    p.add_argument("--cluster", action="store_true",
                   help="three brokers and Redis behind Sentinel, the cluster faults, a mix of jobs")
    a = p.parse_args()
    import logging

    # The soak's own client retries through every broker fault (aiokafka logs each retry);
    # what it could not submit is in the report, and the workers' logs are kept.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    report = asyncio.run(run_soak(a))
    out = Path(a.out) / "soak.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("jobs", "cancelled_sent", "finish_reasons", "restarted_jobs",
                                             "log_expired", "defects", "worker_exits")}, indent=1))
    print(f"faults: {[(f.get('t'), f.get('fault') or f.get('note')) for f in report['faults']]}")
    for e in report["fault_effects"]:
        print(f"  {e['fault']:<18} {e['window']}  starts/s {e['starts_per_s']} ({e['vs_steady']}x steady), "
              f"longest wait to start {e['max_wait_to_start_s']} s")
    print(f"wrote {out}; worker logs in {report['worker_logs']}")


if __name__ == "__main__":
    main()
