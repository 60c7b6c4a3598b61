"""Recurrent-state and hybrid models (`worker/model/recurrent.py`): the state slots beside
the paged KV — exact against transformers' `generate` through chunked prefill, forced
preemption and asynchronous steps; freed at the step after a cancel; inside the memory
budget; and the features a state cannot serve turned off or refused at load."""

from __future__ import annotations

import re

import pytest
import torch

from schemas.params import SamplingParams
from tests.conftest import arch_checkpoint
from tools.tiny_archs import STATE_FAMILIES, reference, run_engine, staggered_requests
from worker.config import ConfigError, EngineConfig, ModelConfig, ServingTuning
from worker.config.speculative import SpeculativeConfig
from worker.engine import Engine
from worker.engine.engine import kv_bytes_per_token, state_bytes
from worker.model.recurrent import (
    CONV,
    RECURRENT,
    RecurrentStep,
    SlotCache,
    StateLayout,
    StatePool,
    StateSpec,
    installed,
)


def _engine(family: str, **tuning) -> Engine:
    fields = dict(max_total_tokens=2048, kv_block_size=16, max_batched_tokens=16, max_running_requests=4)
    fields.update(tuning)
    cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu", attention_backend="torch"),
                       serving_tuning=ServingTuning(**fields))
    return Engine.from_pretrained(str(arch_checkpoint(family)), cfg)


def test_slot_cache_keeps_what_transformers_cache_layer_keeps():
    """The same updates through our slot cache and transformers' `LinearAttentionLayer`:
    a prefill shorter than the kernel (left-padded), one longer, then single tokens on
    top of a state: the same windows returned and the same states kept, per slot."""
    from transformers.cache_utils import LinearAttentionLayer

    kernel, channels = 4, 3
    layout = StateLayout((StateSpec(0, CONV, 0, (channels, kernel), torch.float32),
                          StateSpec(0, RECURRENT, 0, (channels, 5), torch.float32)))
    pool = StatePool(layout, num_slots=3, device=torch.device("cpu"))
    step = RecurrentStep(pool, 0, torch.zeros(0, dtype=torch.long), [])
    gen = torch.Generator().manual_seed(0)
    for slot, prefill_len in ((2, 2), (0, 7)):
        theirs = LinearAttentionLayer()
        slots = torch.tensor([slot])
        x = torch.randn(1, channels, prefill_len, generator=gen)
        ours = SlotCache(step, 0, slots, previous=False)
        assert ours.get_conv_state(0) is None and ours.get_recurrent_state(0) is None
        assert torch.equal(ours.update_conv_state(x, 0, conv_kernel_size=kernel),
                           theirs.update_conv_state(x, conv_kernel_size=kernel))
        r = torch.randn(1, channels, 5, generator=gen)
        ours.update_recurrent_state(r, 0)
        theirs.update_recurrent_state(r)
        ours.scatter()
        for _ in range(3):
            x = torch.randn(1, channels, 1, generator=gen)
            ours = SlotCache(step, 0, slots, previous=True)
            assert torch.equal(ours.get_conv_state(0), theirs.conv_states[0])
            assert torch.equal(ours.get_recurrent_state(0), theirs.recurrent_states[0])
            assert torch.equal(ours.update_conv_state(x, 0, conv_kernel_size=kernel),
                               theirs.update_conv_state(x, conv_kernel_size=kernel))
            ours.scatter()
        assert torch.equal(pool.tensors[(0, CONV, 0)][slot], theirs.conv_states[0][0])
    assert not pool.tensors[(0, CONV, 0)][1].any(), "a slot no request held was written"


STATE_MODELS = ["Jamba", "Qwen3-Next", *STATE_FAMILIES]


@pytest.mark.parametrize("family, async_steps", [(f, i % 2 == 1) for i, f in enumerate(STATE_MODELS)])
def test_exact_through_preemption_and_async_steps(family, async_steps):
    """Every recurrent family: four requests of 30 + 24 tokens (4 blocks each) in 16-token
    chunks, asynchronous steps in every other family, under a KV budget of 8 blocks (3 for
    the windowed hybrid, whose requests hold at most 3 blocks each): all are admitted,
    decodes outgrow the blocks, and requests are preempted and recomputed from a fresh
    state."""
    path = arch_checkpoint(family)
    requests = staggered_requests(lens=((30, 0), (30, 0), (30, 1), (30, 2)))
    preemptions = []
    kv_tokens = 48 if family == "LaRA-mini" else 128  # the windowed hybrid frees behind its 16-token window
    got = run_engine(path, requests, 24, max_total_tokens=kv_tokens, async_scheduling=async_steps,
                     on_step=lambda e: (preemptions.append(e.scheduler.num_preemptions_total),
                                        e.check_invariants()))
    assert preemptions[-1] > 0, "the budget must force preemption"
    ref = reference(path, requests, 24)
    assert {rid: ids for rid, (ids, _) in got.items()} == ref


def test_a_cancel_frees_the_state_slot_at_the_next_step():
    engine = _engine("Mamba")
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, prompt_token_ids=list(range(1, 20)), params=params)
    for _ in range(4):
        engine.step()
    kv = engine.core.kv
    held = dict(kv._state_slots)
    assert set(held) == {"a", "b", "c"} and len(set(held.values())) == 3
    engine.abort("b")
    engine.step()
    assert "b" not in kv._state_slots and held["b"] in kv._free_state_slots
    engine.check_invariants()
    engine.add_request("d", prompt_token_ids=list(range(5, 30)), params=params)
    engine.step()
    assert kv._state_slots["d"] == held["b"], "the freed slot is taken by the next request"
    engine.check_invariants()


def test_state_and_kv_stay_within_the_budget():
    """With `kv_cache_bytes`, the state slots of `max_running_requests` requests come out of
    the bytes first; KV blocks + states never exceed them, and no more requests than
    slots ever hold blocks."""
    budget = 2_000_000
    engine = _engine("Jamba", max_total_tokens=None, kv_cache_bytes=budget, max_running_requests=4)
    loaded_states = engine.runner.state_pool
    assert loaded_states is not None and loaded_states.num_slots == 4
    tuning = engine.tuning
    block_bytes = kv_bytes_per_token(engine.loaded, tuning) * tuning.kv_block_size
    assert loaded_states.nbytes == state_bytes(engine.loaded, tuning) > 0
    assert engine.core.kv.num_blocks * block_bytes + loaded_states.nbytes <= budget
    assert (engine.core.kv.num_blocks + 1) * block_bytes + loaded_states.nbytes > budget
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(10):
        engine.add_request(f"r{i}", prompt_token_ids=[1 + i, 2, 3, 4, 5], params=params)
    while engine.has_unfinished():
        engine.step()
        assert len(engine.core.kv._state_slots) <= 4
        engine.check_invariants()


def test_a_budget_that_cannot_hold_the_states_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_cache_bytes .* does not hold the recurrent state"):
        _engine("Jamba", max_total_tokens=None, kv_cache_bytes=1000)


def test_what_a_state_cannot_serve_is_off_or_refused(tmp_path):
    engine = _engine("Qwen3-Next", speculative=SpeculativeConfig(method="ngram"))
    assert not engine.core.kv.enable_prefix_caching, "a state is not a set of shareable blocks"
    assert engine.core.scheduler.speculation is None, "a state cannot take back rejected guesses"
    assert not engine.compile_report.compiled and "recurrent-state layers run eager" in engine.compile_report.reason
    with pytest.raises(ConfigError, match="host_kv_bytes is not served for a model with recurrent-state layers"):
        _engine("Mamba", host_kv_bytes=1 << 20)
    cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu", lora_dir=str(tmp_path)),
                       serving_tuning=ServingTuning(max_total_tokens=512))
    with pytest.raises(ConfigError, match="lora_dir is not served for a model with recurrent-state layers"):
        Engine.from_pretrained(str(arch_checkpoint("Mamba")), cfg)


@pytest.mark.parametrize("family, continues", [("Mamba", False), ("Mamba-2", True), ("Qwen3-Next", True)])
def test_chunks_continue_by_the_sequence_path_where_it_takes_a_state(family, continues):
    """transformers' Mamba scan starts from zeros whatever the cache holds, so its
    continuing chunks go token by token; Mamba-2's and the gated delta net's take the
    state (measured at load, `probe_continuation`)."""
    mixers = installed(_engine(family).runner.model)
    assert mixers and all(m._inflight_continues_state is continues for m in mixers)


def test_structured_outputs_and_priorities_on_a_hybrid():
    """The masks are the sampler's, the priorities the scheduler's: a hybrid serves both
    (regex and choice constrained requests at two priorities in one batch)."""
    from schemas.params import ChoiceOutput, RegexOutput
    from worker.engine import Priority

    engine = _engine("Jamba", max_batched_tokens=64)
    choices = ["yes", "no", "maybe"]
    params = ([SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured=ChoiceOutput(choices=choices))
               for s in range(3)]
              + [SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                structured=RegexOutput(pattern=r"[0-9]{3}-[a-z]{2,4}")) for s in range(3)])
    for i, p in enumerate(params):
        engine.add_request(f"s{i}", "Pick one:", params=p, priority=Priority.HIGH if i % 2 else Priority.LOW)
    texts = {f"s{i}": "" for i in range(len(params))}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.text  # each output carries its new text
    for i in range(3):
        assert texts[f"s{i}"] in choices
    for i in range(3, 6):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts[f"s{i}"], re.ASCII), texts[f"s{i}"]


def test_a_recurrent_draft_model_is_refused_at_load(llama_path):
    """The draft model's runner keeps no state slots: a hybrid draft is a config error."""
    cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=ServingTuning(
        max_total_tokens=512, speculative=SpeculativeConfig(method="draft", draft_model=str(arch_checkpoint("Mamba")))))
    with pytest.raises(ConfigError, match="draft_model has recurrent-state layers"):
        Engine.from_pretrained(str(llama_path), cfg)
