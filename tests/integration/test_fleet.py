"""Several workers, crashes, shutdown and backpressure on the real Kafka and Redis."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from schemas.params import SamplingParams
from schemas.wire import Restarted
from tests.integration.conftest import worker_config
from tests.integration.helpers import (
    assert_well_formed,
    collect,
    committed_reaches_end,
    running_on,
    start_worker,
    stop_worker,
    wait_group_members,
)
from tests.integration.processes import spawn_worker, wait_for_starts, wait_started
from worker.client import InflightClient
from worker.config import EngineConfig, ServingTuning
from worker.engine import Engine
from worker.model.null_runner import NullRunner, null_engine


def test_backpressure_bounds_local_jobs_and_a_new_worker_takes_a_share(services, prefix, llama_path):
    cfg = worker_config(services, prefix, tuning={"max_running_requests": 8}, worker={"max_local_jobs": 16})
    e1 = Engine.from_pretrained(str(llama_path), cfg.engine)
    e2 = Engine.from_pretrained(str(llama_path), cfg.engine)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def main():
        w1, t1 = await start_worker(cfg, e1)
        peak = {"w1": 0, "w2": 0}
        stop = asyncio.Event()
        workers = {"w1": w1}

        async def sample():
            while not stop.is_set():
                for k, w in workers.items():
                    peak[k] = max(peak[k], w.num_local_jobs)
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            ids = [f"bp-{i}" for i in range(500)]
            await asyncio.gather(*(client.submit(f"load {i}", params=params, job_id=j, priority=("high", "normal", "low")[i % 3])
                                   for i, j in enumerate(ids)))
            w2, t2 = await start_worker(cfg, e2)
            workers["w2"] = w2
            results = await asyncio.gather(*(collect(client, j, 300) for j in ids))
        stop.set()
        await sampler
        committed = await committed_reaches_end(services[0], cfg.kafka.group_id, prefix)
        await asyncio.gather(stop_worker(w1, t1), stop_worker(w2, t2))
        return ids, results, peak, w1, w2, committed

    ids, results, peak, w1, w2, committed = asyncio.run(main())
    for j, evs in zip(ids, results):
        assert assert_well_formed(evs, j).finish_reason == "length"
    assert peak["w1"] <= 16 and peak["w2"] <= 16, peak
    assert w1.num_finished > 0 and w2.num_finished > 0, (w1.num_finished, w2.num_finished)
    assert w1.num_finished + w2.num_finished == 500
    assert all(c == e for c, e in committed.values()), committed


class SlowRunner(NullRunner):
    """A model that takes `delay_s` per step."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(vocab_size=100, avoid=frozenset({0}))
        self.delay_s = delay_s

    def execute(self, sched):
        time.sleep(self.delay_s)
        return super().execute(sched)


def test_job_longer_than_max_poll_interval_keeps_the_worker_in_the_group(services, prefix):
    cfg = worker_config(services, prefix, kafka={"max_poll_interval_ms": 3000})
    engine = null_engine(EngineConfig(serving_tuning=ServingTuning(max_total_tokens=4096)), vocab_size=100)
    engine.runner = SlowRunner(0.1)

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            t0 = time.monotonic()
            await client.submit("slow", params=SamplingParams(max_tokens=60, ignore_eos=True), job_id="slow")
            events = await collect(client, "slow", 60)
            took = time.monotonic() - t0
        revocations = w.intake.num_revocations
        await stop_worker(w, task)
        return events, took, revocations

    events, took, revocations = asyncio.run(main())
    assert took > 5.0  # longer than max_poll_interval_ms
    fin = assert_well_formed(events, "slow")
    assert fin.finish_reason == "length" and fin.attempt == 1
    assert not any(isinstance(e, Restarted) for e in events)
    assert revocations == 0


# ---- worker processes -----------------------------------------------------------------------
def test_kill_9_one_of_two_workers_loses_nothing(services, prefix, llama_path, tmp_path):
    model = {"path": str(llama_path), "dtype": "float32", "device": "cpu"}
    cfg = worker_config(services, prefix, model=model, tuning={"max_running_requests": 2}, worker={"max_local_jobs": 4})
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    a, a_log = spawn_worker(tmp_path, cfg, "worker-a")
    # the survivor runs what is left (~4000 tokens) eight at a time: two at a time it took 2000+ steps
    survivor = worker_config(services, prefix, model=model, tuning={"max_running_requests": 8},
                             worker={"max_local_jobs": 8})
    b, b_log = spawn_worker(tmp_path, survivor, "worker-b")
    try:
        async def main():
            await asyncio.gather(wait_started(a_log, a), wait_started(b_log, b))
            await wait_group_members(services[0], cfg.kafka.group_id, 2)
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
                ids = [f"k-{i}" for i in range(20)]
                for i, j in enumerate(ids):
                    await client.submit(f"crash test {i}", params=params, job_id=j, priority=("high", "normal", "low")[i % 3])
                on_a = await wait_for_starts(client, ids, "worker-a", 2)
                on_a.add(await running_on(client, ids, "worker-a"))  # killed while it holds one
                a.send_signal(signal.SIGKILL)
                a.wait()
                results = await asyncio.gather(*(collect(client, j, 180) for j in ids))
            committed = await committed_reaches_end(services[0], cfg.kafka.group_id, prefix, timeout=30)
            return ids, on_a, results, committed

        ids, on_a, results, committed = asyncio.run(main())
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()
    restarted = 0
    for j, evs in zip(ids, results):
        fin = assert_well_formed(evs, j)
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 200
        if any(isinstance(e, Restarted) for e in evs):
            restarted += 1
            assert fin.attempt >= 2
    # every job that was running on the killed worker was re-run, visibly
    interrupted = [j for j, evs in zip(ids, results) if j in on_a and evs[-1].attempt > 1]
    assert interrupted, "jobs running on the killed worker must be restarted elsewhere"
    assert restarted >= len(interrupted)
    assert all(c == e for c, e in committed.values()), committed


def test_sigterm_under_load_drains_or_hands_back(services, prefix, llama_path, tmp_path):
    model = {"path": str(llama_path), "dtype": "float32", "device": "cpu"}
    cfg = worker_config(services, prefix, model=model,
                        tuning={"max_running_requests": 2, "max_output_tokens": 1000},
                        worker={"max_local_jobs": 4, "drain_timeout_s": 0.3})
    # 1000 tokens (the tiny model's context is 1024): a job must outlast the 0.3 s drain on
    # any machine; 250 tokens took 0.15 s in the engine alone on a fast box and then the
    # running jobs finished inside the drain, with nothing to hand back
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    proc, log = spawn_worker(tmp_path, cfg, "worker-t")
    try:
        async def main():
            await wait_started(log, proc)
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
                ids = [f"s-{i}" for i in range(10)]
                for i, j in enumerate(ids):
                    await client.submit(f"drain {i}", params=params, job_id=j)
                await wait_for_starts(client, ids, "worker-t", 2)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                while proc.poll() is None and time.monotonic() - t0 < 30:
                    await asyncio.sleep(0.1)
                exit_s = time.monotonic() - t0
                # the worker that finishes them runs all ten at once (the stopped one ran two:
                # 1000-token jobs two at a time cost 5000+ steps here)
                after = worker_config(services, prefix, model=model, worker={"max_local_jobs": 10},
                                      tuning={"max_running_requests": 10, "max_output_tokens": 1000})
                engine = Engine.from_pretrained(str(llama_path), after.engine)
                w, task = await start_worker(after, engine)
                results = await asyncio.gather(*(collect(client, j, 180) for j in ids))
                committed = await committed_reaches_end(services[0], cfg.kafka.group_id, prefix, timeout=30)
                await stop_worker(w, task)
            return ids, exit_s, results, committed

        ids, exit_s, results, committed = asyncio.run(main())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert exit_s < 0.3 + 10.0  # drain deadline + closing
    assert "handed back unfinished jobs" in log.read_text()
    handed = 0
    for j, evs in zip(ids, results):
        fin = assert_well_formed(evs, j)
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 1000
        handed += any(isinstance(e, Restarted) for e in evs)
    assert handed >= 1
    assert all(c == e for c, e in committed.values()), committed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_drains_the_running_jobs(services, prefix, llama_path, tmp_path, sig):
    """Ctrl-C in a terminal (SIGINT), or systemd stopping the unit's control group
    (SIGTERM), signals the worker and its engine-core process alike: the core ignores it
    (its worker stops it), so the jobs running when it came finish in the drain, as with
    a signal to the worker alone; before, the core died at once and they were handed back."""
    cfg = worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu"},
                        tuning={"max_running_requests": 2, "max_output_tokens": 1000},
                        worker={"drain_timeout_s": 120})
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    ids = ["g-0", "g-1"]
    proc, log = spawn_worker(tmp_path, cfg, "worker-g", new_session=True)
    try:
        async def main():
            await wait_started(log, proc)
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
                for j in ids:
                    await client.submit("a group signal", params=params, job_id=j)
                await wait_for_starts(client, ids, "worker-g", 2)
                os.killpg(proc.pid, sig)
                return await asyncio.gather(*(collect(client, j, 120) for j in ids))

        results = asyncio.run(main())
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert not [e for e in events if e.get("level") in ("error", "critical")], text[-3000:]
    drains = [e for e in events if e.get("event") == "draining"]
    assert drains and drains[0]["running"] >= 1, drains  # jobs were running when the signal came
    for j, evs in zip(ids, results):
        fin = assert_well_formed(evs, j)
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 1000
        assert not any(isinstance(e, Restarted) for e in evs), j  # finished in the drain, not handed back


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_a_silently_stalled_consumer_is_recreated(services, prefix, llama_path):
    """The intake's watchdog: the consumer returns nothing although its partitions have
    jobs (as aiokafka was seen to do after a group member died) -> a fresh consumer."""
    cfg = worker_config(services, prefix, kafka={"stall_timeout_s": 3.0})
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)

    async def main():
        w, task = await start_worker(cfg, engine)
        stalled = w.intake.consumer

        async def silent_getmany(*partitions, timeout_ms=0, max_records=None):
            await asyncio.sleep(timeout_ms / 1000)
            return {}

        stalled.getmany = silent_getmany
        await asyncio.sleep(0.5)  # let a getmany already in flight (the real one) return first
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            await client.submit("stalled", params=SamplingParams(temperature=0, max_tokens=3), job_id="stalled")
            events = await collect(client, "stalled", 90)
        restarts = w.intake.num_consumer_restarts
        replaced = w.intake.consumer is not stalled
        await stop_worker(w, task)
        return events, restarts, replaced

    events, restarts, replaced = asyncio.run(main())
    assert assert_well_formed(events, "stalled").finish_reason in ("stop", "length")
    assert restarts == 1 and replaced
