"""The worker with `model.engine: vllm` on the real Kafka and Redis (tools/stack/devstack.sh):
jobs stream in order and finish once at every priority, with the ids Inflight's own
engine gives on the same checkpoint; a cancel message ends a running job; the committed
offsets reach the end of every partition."""

from __future__ import annotations

import asyncio

from schemas.params import SamplingParams
from schemas.wire import Started, Token
from tests.integration.conftest import worker_config
from tests.integration.helpers import (
    assert_well_formed,
    collect,
    committed_reaches_end,
    finished_within,
    running_worker,
    token_ids,
    wait_until,
)
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
