"""LoRA adapters through Kafka and Redis (issue 30): jobs naming adapters of the
worker's `model.lora_dir` (the engine in its own process, as users run it) stream
exactly the tokens of the adapter merged by peft; an adapter added to the directory
while the worker runs is served without a restart; an unknown or invalid adapter is one
`rejected` event (`unknown_adapter` / `invalid_adapter`) and one DLQ record."""

from __future__ import annotations

import asyncio

import pytest

from schemas.params import SamplingParams
from tests.engine.test_lora import ADAPTERS, references
from tests.integration.conftest import worker_config
from tests.integration.helpers import assert_well_formed, collect, committed_reaches_end, running_worker
from tests.integration.test_worker_faults import read_dlq
from tools.make_lora import make_adapter
from worker.client import InflightClient


@pytest.fixture(scope="module")
def lora_dir(llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    for i, (name, (rank, kw)) in enumerate(ADAPTERS.items()):
        make_adapter(llama_path, root / name, rank, seed=i + 1, **kw)
    return root


def test_jobs_of_several_adapters_stream_the_merged_models_tokens(services, prefix, llama_path, lora_dir):
    cfg = worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu",
                                                 "lora_dir": str(lora_dir), "max_loras": 2},
                        worker={"engine_process": True})
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    work = [(f"j{i}", [1 + i, 20, 30 + i, 40], 12, adapter)
            for i, adapter in enumerate([None, "a4", "b8", "c16", "a4", None, "c16", "b8", "late"])]

    async def main():
        async with running_worker(cfg, timeout=120) as w, InflightClient(
                services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            make_adapter(llama_path, lora_dir / "late", 8, seed=9)  # added while the worker runs
            for rid, prompt, _, adapter in work:
                await client.submit(prompt_token_ids=prompt, params=sp, job_id=rid, adapter=adapter)
            await client.submit(prompt_token_ids=[1, 2], params=sp, job_id="unknown", adapter="nope")
            (lora_dir / "broken").mkdir(exist_ok=True)
            (lora_dir / "broken" / "adapter_config.json").write_text('{"peft_type": "LORA", "use_dora": true}')
            (lora_dir / "broken" / "adapter_model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}")
            await client.submit(prompt_token_ids=[1, 2], params=sp, job_id="invalid", adapter="broken")
            events = await asyncio.gather(*(collect(client, j, 120) for j in [w[0] for w in work] + ["unknown",
                                                                                                    "invalid"]))
            dlq = await read_dlq(services[0], prefix, 2)
            committed = await committed_reaches_end(services[0], cfg.kafka.group_id, prefix, timeout=30)
            return events, dlq, committed, w.metrics

    events, dlq, committed, metrics = asyncio.run(main())
    refs = references(llama_path, lora_dir, work)
    by_id = {evs[0].job_id: evs for evs in events}
    for rid, *_, adapter in work:
        fin = assert_well_formed(by_id[rid], rid)
        tokens = [t for e in by_id[rid] if type(e).__name__ == "Token" for t in e.token_ids]
        assert fin.finish_reason == "length" and tokens == refs[rid], (rid, adapter)
    for rid, code in (("unknown", "unknown_adapter"), ("invalid", "invalid_adapter")):
        fin = assert_well_formed(by_id[rid], rid)
        assert fin.finish_reason == "rejected" and fin.error.code == code, (rid, fin)
    assert sorted((dict(r.headers)["inflight.reason"], r.key) for r in dlq) == [
        (b"invalid_adapter", b"invalid"), (b"unknown_adapter", b"unknown")]
    assert all(c == e for c, e in committed.values()), committed
    registry = metrics.registry
    assert registry.get_sample_value("lora_loads_total") >= 4  # a4 b8 c16 late through 2 slots
    assert registry.get_sample_value("lora_evictions_total") >= 2
    assert registry.get_sample_value("lora_requests_total", {"adapter": "a4"}) == 2
