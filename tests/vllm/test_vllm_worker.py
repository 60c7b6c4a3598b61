"""The worker with `model.engine: vllm` on the real Kafka and Redis (tools/stack/devstack.sh):
jobs stream in order and finish once at every priority, with the ids Inflight's own
engine gives on the same checkpoint; a cancel message ends a running job; the committed
offsets reach the end of every partition; a worker killed with SIGKILL leaves no vLLM
process behind and its jobs are handed back and finish once elsewhere."""

from __future__ import annotations

import asyncio
import signal
import time

import psutil

from schemas.params import SamplingParams
from schemas.wire import Restarted, Started, Token
from tests.integration.conftest import worker_config
from tests.integration.helpers import (
    assert_well_formed,
    collect,
    committed_reaches_end,
    finished_within,
    running_on,
    running_worker,
    token_ids,
    wait_until,
)
from tests.integration.processes import spawn_worker, wait_for_starts, wait_started
from worker.client import InflightClient
from worker.config import EngineConfig, ModelConfig
from worker.engine import Engine

PRIOS = ("high", "normal", "low")


def vllm_worker_config(services, prefix, vllm_python, path):
    return worker_config(services, prefix, model={
        "path": str(path), "dtype": "float32", "engine": "vllm", "vllm_python": vllm_python,
        "vllm_args": {"enforce_eager": True}}, tuning={"enable_prefix_caching": False})


def test_jobs_stream_in_order_finish_once_and_a_cancel_ends_a_running_one(services, prefix, vllm_python,
                                                                         vllm_llama_path):
    cfg = vllm_worker_config(services, prefix, vllm_python, vllm_llama_path)
    prompts = [f"Job {i}: the module provides" for i in range(9)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(9)]

    async def main():
        async with running_worker(cfg) as w, InflightClient(services[0], services[1], topic_prefix=prefix,
                                                             key_prefix=prefix) as client:
            assert w.engine.forward.startswith("vLLM ")
            ids = [await client.submit(p, params=sp, priority=PRIOS[i % 3], job_id=f"job-{i}")
                   for i, (p, sp) in enumerate(zip(prompts, params))]
            results = await asyncio.gather(*(collect(client, j) for j in ids))
            long_id = await client.submit("A long one", params=SamplingParams(max_tokens=250, ignore_eos=True),
                                          job_id="long")
            seen: list = []

            async def read():
                async for ev in client.stream(long_id, timeout_s=120):
                    seen.append(ev)

            reader = asyncio.create_task(read())
            await wait_until(lambda: sum(isinstance(e, Token) for e in seen) >= 2, 120, "the long job's tokens")
            await client.cancel(long_id)
            await finished_within(reader, 120, "the long job's stream")
            committed = await committed_reaches_end(services[0], cfg.kafka.group_id, prefix)
        return ids, results, seen, committed

    ids, results, seen, committed = asyncio.run(main())
    ours = Engine.from_pretrained(str(vllm_llama_path), EngineConfig(model=ModelConfig(dtype="float32",
                                                                                      device="cpu")))
    reference = ours.generate(prompts, params)
    for jid, events, ref, sp in zip(ids, results, reference, params, strict=True):
        fin = assert_well_formed(events, jid)  # ordered seqs, one terminal event
        assert isinstance(events[0], Started) and events[0].attempt == 1
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == sp.max_tokens
        assert token_ids(events) == ref.token_ids, jid
    fin = assert_well_formed(seen, "long")
    assert fin.finish_reason == "cancelled" and fin.usage.completion_tokens < 250
    assert committed


def test_kill_9_of_a_vllm_worker_leaves_no_engine_process_and_its_jobs_finish_elsewhere(
        services, prefix, vllm_python, vllm_llama_path, tmp_path):
    """The worker's engine core (vLLM's interpreter) and vLLM's own worker process must go
    with the worker: on a GPU an orphan would keep the memory the restarted worker needs.
    The jobs it held are taken by a worker on Inflight's engine (a group may mix them)."""
    long = {"enable_prefix_caching": False, "max_output_tokens": 1000}  # jobs that outlast the kill on any box
    cfg = worker_config(services, prefix, model={
        "path": str(vllm_llama_path), "dtype": "float32", "engine": "vllm", "vllm_python": vllm_python,
        "vllm_args": {"enforce_eager": True}}, tuning=long)
    params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    proc, log = spawn_worker(tmp_path, cfg, "vllm-a")
    try:
        async def main():
            await wait_started(log, proc)
            engine_procs = psutil.Process(proc.pid).children(recursive=True)
            assert any("vllm_core" in " ".join(p.cmdline()) for p in engine_procs), engine_procs
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
                ids = [f"v-{i}" for i in range(4)]
                for i, j in enumerate(ids):
                    await client.submit(f"kill test {i}", params=params, job_id=j)
                await wait_for_starts(client, ids, "vllm-a", 2)
                held = await running_on(client, ids, "vllm-a")
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                deadline = time.monotonic() + 60
                while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engine_procs):
                    assert time.monotonic() < deadline, [p.cmdline()[:3] for p in engine_procs if p.is_running()]
                    await asyncio.sleep(0.2)
                taker = worker_config(services, prefix, model={"path": str(vllm_llama_path), "dtype": "float32",
                                                               "device": "cpu"}, tuning=long)
                async with running_worker(taker):
                    results = await asyncio.gather(*(collect(client, j, 180) for j in ids))
                committed = await committed_reaches_end(services[0], cfg.kafka.group_id, prefix, timeout=30)
            return ids, held, results, committed

        ids, held, results, committed = asyncio.run(main())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for j, evs in zip(ids, results, strict=True):
        fin = assert_well_formed(evs, j)
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 900
    interrupted = dict(zip(ids, results, strict=True))[held]
    assert any(isinstance(e, Restarted) for e in interrupted) and interrupted[-1].attempt >= 2
    assert all(c == e for c, e in committed.values()), committed
