"""The host-memory KV tier's bookkeeping (`worker.engine.kv_host`, `KVCacheManager` with
`host_slots`) and its copies (`worker.model.host_kv`): what is saved when, what a lookup
restores, the order the copies run in, and the runner's hash check."""

from __future__ import annotations

import random

import pytest
import torch

from schemas.params import SamplingParams
from worker.engine.kv_cache import KVCacheManager
from worker.engine.kv_host import HostKVIndex, KVCopy, KVCopyError
from worker.engine.request import Request
from worker.model.host_kv import CopyBatch, HostKVBuffers, copy_batches

BS = 4


def req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), max_tokens=4)


def run_prefill(kv: KVCacheManager, r: Request) -> list[int]:
    """Admit `r` with its cached prefix, compute its whole prompt, register its blocks;
    returns the prefix blocks the lookup found."""
    hits = kv.find_cached_prefix(r)
    assert kv.allocate(r, r.num_tokens - len(hits) * BS, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return hits


def test_index_saves_once_and_drops_the_least_recently_used():
    host = HostKVIndex(2)
    host.evicted(5, b"a")
    host.evicted(6, b"b")
    host.evicted(7, b"a")  # held already: no copy, most recently used now
    assert host.take_copies() == [KVCopy(True, 5, 0, b"a"), KVCopy(True, 6, 1, b"b")]
    host.evicted(8, b"c")  # full: "b" is the least recently used
    assert host.find([b"b"]) == [] and host.find([b"a"]) == [0] and host.find([b"c"]) == [1]
    assert host.take_copies() == [KVCopy(True, 8, 1, b"c")]
    assert host.find([b"a", b"c", b"x", b"a"]) == [0, 1]  # in a row, up to the first miss
    with pytest.raises(KVCopyError):
        host.restore(0, 3, b"c")  # slot 0 holds "a"
    assert (host.num_saved, host.num_used) == (3, 2)


def test_evicted_prefix_comes_back_from_the_host_tier():
    kv = KVCacheManager(6, BS, host_slots=8)
    a = req("a", list(range(1, 14)))  # 13 tokens: 3 full blocks, at most 3 hits
    assert run_prefill(kv, a) == []
    kv.free("a")
    assert kv.take_copies() == []  # cached on the device: nothing to save yet
    b = req("b", list(range(100, 124)))  # 24 tokens: all 6 blocks, evicting a's 3 cached ones
    run_prefill(kv, b)
    saves = kv.take_copies()
    assert [c.to_host for c in saves] == [True] * 3
    assert [c.block_hash for c in saves] == a.block_hashes[2::-1]  # a prefix's tail is evicted first
    kv.free("b")
    a2 = req("a2", list(range(1, 14)) + [99])
    hits = run_prefill(kv, a2)
    assert len(hits) == 3  # the whole prefix, restored
    copies = kv.take_copies()
    loads = [c for c in copies if not c.to_host]
    assert [(c.block_id, c.block_hash) for c in loads] == list(zip(hits, a.block_hashes[:3]))
    assert {c.slot for c in loads} == {c.slot for c in saves}
    # each block taken for a load evicted one of b's cached blocks, saved before the load
    # into it; the allocation's own new block evicted one more
    assert [c.to_host for c in copies] == [True, False] * 3 + [True]
    assert all(s.block_id == ld.block_id for s, ld in zip(copies[0::2], copies[1::2]))
    assert kv.host.num_loaded == 3
    kv.check_invariants()
    s = kv.stats()
    assert (s.host_blocks, s.host_used_blocks) == (8, 7)


def test_device_hits_are_pinned_while_host_blocks_are_restored():
    """A prefix half on the device (cached, unreferenced) and half in the host tier: the
    blocks taken for the host half are never the device half's own."""
    kv = KVCacheManager(4, BS, host_slots=8)
    a = req("a", list(range(1, 14)))  # 13 tokens: 4 blocks, 3 of them full
    run_prefill(kv, a)
    kv.free("a")  # free queue, first taken first: a's partial block, then its blocks 2, 1, 0
    run_prefill(kv, req("b", [7, 7, 7, 7, 8]))  # 2 blocks: a's partial one and its block 2 (saved)
    kv.free("b")  # free queue: a's blocks 1 and 0 (device hits), then b's two
    assert [c.block_hash for c in kv.take_copies()] == [a.block_hashes[2]]
    hits = run_prefill(kv, req("a2", list(range(1, 15))))
    # blocks 0 and 1 from the device, block 2 restored into a block that is neither
    assert len(hits) == 3 and len(set(hits)) == 3 and kv.host.num_loaded == 1
    kv.check_invariants()


def test_no_restore_when_the_prompt_cannot_fit():
    kv = KVCacheManager(4, BS, host_slots=8)
    a = req("a", list(range(1, 14)))
    run_prefill(kv, a)
    kv.free("a")
    run_prefill(kv, req("b", list(range(100, 116))))  # holds all 4 blocks, a's 3 saved
    kv.take_copies()
    assert kv.find_cached_prefix(req("a2", list(range(1, 14)))) == []  # no room: nothing taken
    assert kv.take_copies() == []
    kv.check_invariants()


def test_copy_batches_keep_the_order_where_it_matters():
    S, L = True, False
    cs = [KVCopy(S, 1, 0, b"a"), KVCopy(L, 1, 5, b"x"),  # an eviction for a restore: save, then load, same block
          KVCopy(S, 2, 1, b"b"), KVCopy(L, 2, 6, b"y"),  # and again: the same batch
          KVCopy(S, 1, 2, b"x"),  # saves the block just loaded: the next batch
          KVCopy(S, 3, 6, b"c"),  # into a slot the first batch loads from: not in the first batch
          KVCopy(L, 4, 2, b"x"), KVCopy(L, 4, 0, b"a")]  # a destination twice: a third batch
    assert copy_batches(cs) == [CopyBatch([1, 2], [0, 1], [5, 6], [1, 2]), CopyBatch([1, 3], [2, 6], [2], [4]),
                                CopyBatch([], [], [0], [4])]


@pytest.mark.parametrize("per_block", [False, True], ids=["batched", "per-block"])
def test_copies_run_in_order_and_loads_are_checked(per_block):
    k = torch.arange(6 * 2 * 3, dtype=torch.float32).reshape(6, 2, 3)
    scales = torch.arange(6 * 2, dtype=torch.float32).reshape(6, 2) * -1
    orig_k, orig_s = k.clone(), scales.clone()
    buf = HostKVBuffers([k, scales], 2, per_block=per_block)
    assert buf.bytes_per_slot == (2 * 3 + 2) * 4
    # save 1 -> slot 0, load slot 0 into 4, save 4 -> slot 1 (the loaded content), overwrite slot 0 with 2
    buf.apply([KVCopy(True, 1, 0, b"a"), KVCopy(False, 4, 0, b"a"), KVCopy(True, 4, 1, b"a"),
               KVCopy(True, 2, 0, b"b")])
    assert torch.equal(k[4], orig_k[1]) and torch.equal(scales[4], orig_s[1])
    buf.apply([KVCopy(False, 5, 1, b"a"), KVCopy(False, 0, 0, b"b")])
    assert torch.equal(k[5], orig_k[1]) and torch.equal(k[0], orig_k[2]) and torch.equal(scales[0], orig_s[2])
    assert buf.bytes_saved == 3 * buf.bytes_per_slot and buf.bytes_loaded == 3 * buf.bytes_per_slot
    before = k.clone()
    with pytest.raises(KVCopyError, match="slot 1 holds"):
        buf.apply([KVCopy(True, 3, 0, b"c"), KVCopy(False, 3, 1, b"c")])
    assert torch.equal(k, before)  # checked before any byte moved


def test_batched_copies_equal_copies_one_by_one_in_order():
    """Random save/load sequences over few blocks and slots (so they collide often): the
    batches leave the device and host tensors exactly as running each copy in turn does."""
    rng = random.Random(3)
    for _ in range(200):
        copies = [KVCopy(rng.random() < 0.5, rng.randrange(4), rng.randrange(3), b"") for _ in range(rng.randrange(1, 12))]
        results = []
        for per_block in (False, True):
            k = torch.arange(4 * 5, dtype=torch.float32).reshape(4, 5)
            buf = HostKVBuffers([k], 3, per_block=per_block)
            buf.host_tensors[0].copy_(-torch.arange(3 * 5, dtype=torch.float32).reshape(3, 5))
            (buf._apply_per_block if per_block else buf._apply_batched)(copies)
            results.append((k, buf.host_tensors[0]))
        (k1, h1), (k2, h2) = results
        assert torch.equal(k1, k2) and torch.equal(h1, h2), copies
