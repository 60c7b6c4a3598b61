"""A worker process serving a hybrid model (gated delta net + attention: Qwen3-Next's
tiny config) through Kafka and Redis, its engine in its own process (the default): each
job's tokens are transformers' `generate` ids, a cancelled job ends `cancelled` and its
state slot goes back (the next jobs still match), and the start line names the state."""

from __future__ import annotations

import asyncio

from schemas.params import SamplingParams
from schemas.wire import FinishReason, Token
from tests.conftest import arch_checkpoint
from tests.integration.conftest import worker_config
from tests.integration.helpers import assert_well_formed, collect, token_ids, wait_until
from tests.integration.processes import spawn_worker, wait_started
from tools.tiny_archs import reference, staggered_requests
from worker.client import InflightClient


async def _has_tokens(client: InflightClient, job_id: str) -> bool:
    return any(isinstance(e, Token) for e in await client.read_log(job_id))


def test_a_worker_serves_a_hybrid_model_exactly(services, prefix, tmp_path):
    path = arch_checkpoint("Qwen3-Next")
    cfg = worker_config(services, prefix, model={"path": str(path), "dtype": "float32", "device": "cpu"},
                        tuning={"max_running_requests": 4, "max_batched_tokens": 16, "max_output_tokens": 1000})
    requests = staggered_requests()
    want = reference(path, requests, 24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    proc, log = spawn_worker(tmp_path, cfg, "hybrid")
    try:
        async def main():
            await wait_started(log, proc)
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
                long = await client.submit(prompt_token_ids=[7] * 20, job_id="long",
                                           params=SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
                await wait_until(lambda: _has_tokens(client, long), 60, "the long job's first tokens")
                await client.cancel(long)
                ids = [await client.submit(prompt_token_ids=prompt, params=params, job_id=rid)
                       for rid, prompt, _ in requests]
                return await collect(client, long, 120), {j: await collect(client, j, 120) for j in ids}

        cancelled, done = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(60)
    assert assert_well_formed(cancelled, "long").finish_reason == FinishReason.CANCELLED
    for rid, events in done.items():
        assert assert_well_formed(events, rid).finish_reason == FinishReason.LENGTH
        assert token_ids(events) == want[rid], rid
    text = log.read_text()
    assert "recurrent state in 1 layers (Qwen3NextGatedDeltaNet" in text and "prefix caching is off" in text
