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
        async with running_worker(cfg) as w, InflightClient(
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


def test_the_gateway_serves_adapters_as_models_and_keys_limit_them(services, prefix, llama_path, lora_dir, tmp_path):
    """`<model>:<adapter>` through the official openai client equals the merged model;
    `GET /v1/models` lists the adapters a key may use; a key limited to one adapter gets
    404 for another, and every key 404 for an adapter the gateway does not serve."""
    import openai

    from tests.integration.gateway_helpers import MODEL, client, gateway_config, running_gateway
    from worker.gateway.config import ApiKey

    own = "sk-test-only-b8-adapter"
    cfg = worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu",
                                                 "lora_dir": str(lora_dir)})
    gcfg = gateway_config(services, prefix, tmp_path / "files", adapters=["a4"], lora_dir=str(lora_dir))
    gcfg.gateway.api_keys.append(ApiKey(key=own, tenant="b", adapters=["b8"]))
    prompt = [1, 20, 30, 40]

    async def main():
        from worker.engine import Engine

        engine = Engine.from_pretrained(str(llama_path), cfg.engine)
        async with running_worker(cfg, engine), running_gateway(gcfg) as gw:
            c, mine = client(gw), client(gw, own)
            listed = sorted(m.id for m in (await c.models.list()).data)
            mine_listed = sorted(m.id for m in (await mine.models.list()).data)
            out = {}
            for key_client, model in ((c, f"{MODEL}:a4"), (c, f"{MODEL}:c16"), (mine, f"{MODEL}:b8"), (c, MODEL)):
                r = await key_client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                        extra_body={"ignore_eos": True})
                out[model] = r.choices[0].text
            stream = await c.chat.completions.create(model=f"{MODEL}:a4", stream=True, max_tokens=4,
                                                     messages=[{"role": "user", "content": "hi"}])
            chunks = [ch async for ch in stream]
            errors = {}
            for key_client, model in ((mine, f"{MODEL}:a4"), (c, f"{MODEL}:nope"), (c, "other:a4")):
                with pytest.raises(openai.NotFoundError) as e:
                    await key_client.completions.create(model=model, prompt=prompt, max_tokens=2)
                errors[model] = e.value.code
            return listed, mine_listed, out, chunks, errors, engine.tokenizer

    listed, mine_listed, out, chunks, errors, tok = asyncio.run(main())
    names = [d.name for d in lora_dir.iterdir() if (d / "adapter_config.json").is_file()]  # + the gateway's a4
    assert listed == sorted([MODEL] + [f"{MODEL}:{a}" for a in names]), listed
    assert mine_listed == [MODEL, f"{MODEL}:b8"]
    work = [(m, prompt, 8, m.partition(":")[2] or None) for m in out]
    refs = references(llama_path, lora_dir, work)
    for model, text in out.items():
        assert text == tok.decode(refs[model]), (model, text)
    assert chunks and chunks[0].model == f"{MODEL}:a4"
    assert set(errors.values()) == {"model_not_found"} and len(errors) == 3
