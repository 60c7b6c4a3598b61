"""The host-memory KV tier on a real model (`serving_tuning.host_kv_bytes`): a shared-prefix
workload whose prefixes do not fit the device's cache but fit device + host hits nearly
what an unbounded cache hits, with the same greedy ids as without the tier, and every
block restored from host memory holds exactly what was saved under its hash."""

from __future__ import annotations

import random

import pytest
import torch

from schemas.params import SamplingParams
from worker.config import ConfigError, EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine
from worker.engine.engine import kv_bytes_per_token
from worker.engine.kv_host import KVCopyError

BLOCK = 16
PREFIXES = 8
PREFIX_TOKENS = 64  # 4 blocks each: 32 prefix blocks, twice the device's 16
ROUNDS = 3


def workload():
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 500) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
    return [[(f"r{r}-{p}", prefixes[p] + [rng.randrange(1, 500) for _ in range(5)]) for p in range(PREFIXES)]
            for r in range(ROUNDS)]


def engine_for(path, max_total_tokens: int, host_blocks: int = 0, async_scheduling: bool = False) -> Engine:
    def cfg(host_kv_bytes):
        return EngineConfig(model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=ServingTuning(
            max_total_tokens=max_total_tokens, max_batched_tokens=256, max_running_requests=2,
            kv_block_size=BLOCK, host_kv_bytes=host_kv_bytes, async_scheduling=async_scheduling))
    engine = Engine.from_pretrained(str(path), cfg(None))
    if host_blocks:
        block_bytes = kv_bytes_per_token(engine.loaded, engine.tuning) * BLOCK
        engine = Engine.from_pretrained(str(path), cfg(host_blocks * block_bytes))
        assert engine.kv.host.num_slots == host_blocks
    return engine


def serve(engine: Engine) -> tuple[dict[str, list[int]], int]:
    """Each round's requests added together, run to the end; the ids and the prompt
    tokens served from the cache (the usage's `cached_prompt_tokens`) of rounds 2 on."""
    ids: dict[str, list[int]] = {}
    hit = 0
    for r, reqs in enumerate(workload()):
        for rid, prompt in reqs:
            ids[rid] = []
            engine.add_request(rid, prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=6,
                                                                                    ignore_eos=True))
        while engine.has_unfinished():
            for out in engine.step():
                ids[out.request_id].extend(out.new_token_ids)
                if out.finished and r > 0:
                    hit += out.usage.cached_prompt_tokens
            engine.check_invariants()
    return ids, hit


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sequential", "async"])
def test_host_tier_hits_what_an_unbounded_cache_hits_with_the_same_ids(llama_path, async_scheduling):
    unbounded_ids, unbounded_hit = serve(engine_for(llama_path, 4096))
    device_ids, device_hit = serve(engine_for(llama_path, 16 * BLOCK))
    engine = engine_for(llama_path, 16 * BLOCK, host_blocks=64, async_scheduling=async_scheduling)
    buf = engine.runner.host_kv
    saved: dict[bytes, list[torch.Tensor]] = {}
    checked = []
    apply = buf.apply

    def one_at_a_time(copies):  # the same order; each block's content recorded at its save, compared at its load
        for c in copies:
            apply([c])
            block = [t[c.block_id].clone() for t in buf.device_tensors]
            if c.to_host:
                saved[c.block_hash] = block
            else:
                assert all(torch.equal(a, b) for a, b in zip(block, saved[c.block_hash])), c
                checked.append(c.block_hash)

    buf.apply = one_at_a_time
    ids, hit = serve(engine)
    assert unbounded_hit == (ROUNDS - 1) * PREFIXES * PREFIX_TOKENS
    assert hit >= 0.9 * unbounded_hit, (hit, unbounded_hit, device_hit)
    assert device_hit < 0.5 * unbounded_hit  # the workload does not fit the device's cache alone
    assert ids == unbounded_ids == device_ids
    assert 0 < len(checked) * BLOCK <= hit  # restored blocks are hits (the rest came from the device)
    stats = engine.last_step_stats
    assert stats.host_kv is not None and engine.kv.host.num_loaded == len(checked)
    assert buf.bytes_loaded == len(checked) * buf.bytes_per_slot and buf.copy_s > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sequential", "async"])
def test_a_failed_copy_stops_the_core(llama_path, async_scheduling):
    """Blocks are registered whose content the copy did not bring: nothing may be retried
    around it (a retried request would read them), so the step raises."""
    engine = engine_for(llama_path, 16 * BLOCK, host_blocks=64, async_scheduling=async_scheduling)

    def broken(copies):
        raise RuntimeError("device lost")

    engine.runner.host_kv._apply_batched = broken
    with pytest.raises(KVCopyError, match="device lost"):
        serve(engine)


def test_host_tier_config_errors(llama_path):
    with pytest.raises(ConfigError, match="host_kv_bytes .* holds no KV block"):
        Engine.from_pretrained(str(llama_path), EngineConfig(
            model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=ServingTuning(host_kv_bytes=100)))
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        ServingTuning(host_kv_bytes=1 << 20, enable_prefix_caching=False)


def test_inflight_check_reports_the_host_tier(llama_path):
    from worker.cli.model_checks import model_checks
    from worker.config import WorkerConfig

    def kv_check(host_kv_bytes: int) -> object:
        cfg = WorkerConfig(model=ModelConfig(path=str(llama_path), dtype="float32", device="cpu"),
                           serving_tuning=ServingTuning(max_total_tokens=1024, host_kv_bytes=host_kv_bytes))
        return {c.name: c for c in model_checks(cfg)}["kv cache"]

    engine = engine_for(llama_path, 1024)
    block_bytes = kv_bytes_per_token(engine.loaded, engine.tuning) * BLOCK
    ok = kv_check(10 * block_bytes + 1)
    assert ok.status == "pass" and ok.setting == "serving_tuning.host_kv_bytes", ok
    assert f"host tier 10 blocks ({10 * BLOCK} tokens)" in ok.detail, ok
    too_small = kv_check(block_bytes - 1)
    assert too_small.status == "fail" and "holds no KV block" in too_small.detail, too_small
    too_big = kv_check(1 << 50)
    assert too_big.status == "fail" and "of available RAM" in too_big.detail, too_big
