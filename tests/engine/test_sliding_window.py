"""Sliding-window KV (kv_window.py) on a model windowed in every layer (tiny Mistral,
`sliding_window` 16): requests of 4-9x the window are exact against transformers, hold
no more KV than the window allows, and are admitted on what they really hold."""

from __future__ import annotations

import pytest

from tests.conftest import arch_checkpoint
from tools.tiny_archs import WINDOW, reference, run_engine, staggered_requests
from worker.engine.kv_cache import NULL_BLOCK
from worker.engine.kv_window import SlidingWindowKVCacheManager, peak_blocks

MISTRAL = "Mistral (sliding window)"


def held_blocks(live: dict, decode_live: dict):
    """on_forward: the most KV blocks each request holds in a forward (its table without
    the entries freed behind the window), in any step and in its decode steps."""
    def on_forward(sched):
        for s in sched.scheduled:
            n = sum(1 for b in s.block_ids if b != NULL_BLOCK)
            live[s.request_id] = max(live.get(s.request_id, 0), n)
            if s.num_tokens == 1:
                decode_live[s.request_id] = max(decode_live.get(s.request_id, 0), n)
    return on_forward


def invariants(engine):
    assert isinstance(engine.kv, SlidingWindowKVCacheManager)
    engine.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sequential", "async"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kv_policy", ["optimistic", "reserve"])
def test_requests_of_many_windows_are_exact_and_hold_one_window(block_size, kv_policy, async_scheduling):
    # with steps scheduled one ahead, the next schedule frees blocks behind the window
    # while a step still reads them: that step keeps the table it was scheduled with
    path = arch_checkpoint(MISTRAL)
    requests = staggered_requests(lens=((24, 0), (40, 2), (57, 5), (90, 9)))
    live: dict[str, int] = {}
    decode_live: dict[str, int] = {}
    got = run_engine(path, requests, 60, block_size=block_size, kv_policy=kv_policy, on_step=invariants,
                     on_forward=held_blocks(live, decode_live), async_scheduling=async_scheduling)
    ref = reference(path, requests, 60)
    assert {rid: ids for rid, (ids, _) in got.items()} == ref
    assert len(requests[0][1]) + 60 >= 4 * WINDOW
    window_plus_block = -(-WINDOW // block_size) + 1  # the window and one block more, per layer
    for rid, prompt, _ in requests:
        assert decode_live[rid] <= window_plus_block, (rid, decode_live)
        assert live[rid] <= peak_blocks(len(prompt) + 60, WINDOW, block_size, 16), (rid, live)
        assert len(prompt) + 60 > (window_plus_block + 1) * block_size  # a full table would hold far more


def test_admission_counts_the_window_not_the_length():
    """A KV cache of 8 blocks (128 tokens) serves six 200-token requests: each holds at
    most 3 blocks at once, so they are admitted and run (some together), all exact."""
    path = arch_checkpoint(MISTRAL)
    requests = staggered_requests(lens=((40, 0), (40, 0), (40, 1), (40, 1), (40, 2), (40, 2)), vocab=400)
    live: dict[str, int] = {}
    got = run_engine(path, requests, 160, max_total_tokens=128, on_step=invariants,
                     on_forward=held_blocks(live, {}))
    assert all(reason == "length" and len(ids) == 160 for ids, reason in got.values())
    assert {rid: ids for rid, (ids, _) in got.items()} == reference(path, requests, 160)
    assert max(live.values()) <= peak_blocks(200, WINDOW, 16, 16) == 3
