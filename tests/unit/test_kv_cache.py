"""KV cache manager and block pool: pure logic, no model."""

from __future__ import annotations

import pytest

from schemas.params import SamplingParams
from worker.engine.kv_cache import BlockPool, KVCacheManager
from worker.engine.request import Request


def make_req(rid: str, tokens: list[int], salt: bytes = b"") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4, cache_salt=salt)


def test_pool_take_release_counts():
    pool = BlockPool(4)
    got = pool.take(3)
    assert got == [0, 1, 2]
    assert pool.num_free_blocks == 1
    assert pool.take(2) is None  # running out is a value
    pool.release(got)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="ref count 0"):
        pool.release([0])


def test_block_table_grows_by_block():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    req = make_req("a", list(range(5)))
    assert kv.allocate(req, 5)
    assert len(kv.block_table("a")) == 2
    req.num_computed_tokens = 5
    assert kv.allocate(req, 3)  # 8 tokens still fit in 2 blocks
    assert len(kv.block_table("a")) == 2
    req.num_computed_tokens = 8
    assert kv.allocate(req, 1)
    assert len(kv.block_table("a")) == 3
    kv.free("a")
    assert kv.stats().used_blocks == 0
    kv.check_invariants()


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(2, 4)
    req = make_req("a", list(range(9)))
    assert not kv.allocate(req, 9)
    assert kv.block_table("a") == []
    assert kv.stats().free_blocks == 2


def test_blocks_to_allocate_and_freeable_count_shared_and_revived_blocks():
    kv = KVCacheManager(16, 4)
    a = make_req("a", list(range(10)))
    assert kv.num_blocks_to_allocate(a, 10) == 3
    assert kv.num_blocks_to_allocate(a, 10, reserve_tokens=14) == 4
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    assert kv.num_blocks_to_allocate(a, 2) == 0 and kv.num_blocks_to_allocate(a, 3) == 1
    b = make_req("b", list(range(8)) + [7, 7])
    hits = kv.find_cached_prefix(b)
    assert kv.num_blocks_to_allocate(b, 2, hits) == 1  # shared blocks are not taken from the pool
    assert kv.allocate(b, 2, hits)
    assert kv.num_freeable_blocks("a") == 1 and kv.num_freeable_blocks("b") == 1  # 2 blocks are shared
    kv.free("a")
    assert kv.num_freeable_blocks("b") == 3
    kv.free("b")
    c = make_req("c", list(range(8)) + [1, 1])
    hits = kv.find_cached_prefix(c)
    assert len(hits) == 2 and kv.num_blocks_to_allocate(c, 2, hits) == 3  # 2 revived from the cache + 1 new
    before = kv.num_free_blocks
    assert kv.allocate(c, 2, hits) and kv.num_free_blocks == before - 3
    kv.check_invariants()


def test_prefix_cache_shares_computed_full_blocks_only():
    kv = KVCacheManager(16, 4)
    a = make_req("a", list(range(10)))
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)  # 2 full blocks registered, the partial third is not
    b = make_req("b", list(range(9)) + [99])
    hits = kv.find_cached_prefix(b)
    assert hits == kv.block_table("a")[:2]
    assert kv.allocate(b, 2, hits)
    assert kv.pool.ref_cnt[hits[0]] == 2
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    s = kv.stats()
    assert (s.used_blocks, s.cached_blocks, s.free_blocks) == (0, 2, 14)
    # a third request revives the cached blocks
    c = make_req("c", list(range(8)) + [5, 5])
    hits = kv.find_cached_prefix(c)
    assert len(hits) == 2 and kv.allocate(c, 2, hits)
    assert kv.stats().cached_blocks == 0
    kv.check_invariants()


def test_prefix_cache_leaves_one_token_to_compute():
    kv = KVCacheManager(16, 4)
    a = make_req("a", list(range(8)))
    assert kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    same = make_req("b", list(range(8)))
    assert len(kv.find_cached_prefix(same)) == 1  # (8 - 1) // 4


def test_salt_separates_tenants():
    kv = KVCacheManager(16, 4)
    a = make_req("a", list(range(8)), salt=b"tenant-1")
    assert kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    assert kv.find_cached_prefix(make_req("b", list(range(9)), salt=b"tenant-2")) == []
    assert len(kv.find_cached_prefix(make_req("c", list(range(9)), salt=b"tenant-1"))) == 2


def test_eviction_of_cached_block_drops_its_hash():
    kv = KVCacheManager(2, 4)
    a = make_req("a", list(range(8)))
    assert kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.free("a")
    assert kv.stats().cached_blocks == 2
    other = make_req("o", [50] * 8)
    assert kv.allocate(other, 8)  # evicts both
    assert kv.find_cached_prefix(make_req("x", list(range(9)))) == []
    kv.check_invariants()


def test_state_slots_go_with_the_first_blocks_and_back_with_them():
    """A model with recurrent state (`worker/model/recurrent.py`): a request takes a state
    slot with its first blocks, keeps it while it grows, and gives it back when freed; with
    every slot held, a new request is not allocated (nothing changes), as when blocks run out."""
    kv = KVCacheManager(16, 4, enable_prefix_caching=False, state_slots=2)
    a, b, c = make_req("a", [1] * 5), make_req("b", [2] * 3), make_req("c", [3] * 2)
    assert kv.allocate(a, 5) and kv.allocate(b, 3)
    assert {a.state_slot, b.state_slot} == {0, 1}
    a.num_computed_tokens = 5
    assert kv.allocate(a, 4) and a.state_slot in (0, 1)  # growing keeps the slot
    assert not kv.allocate(c, 2)
    assert kv.block_table("c") == [] and c.state_slot == -1
    kv.check_invariants()
    freed = a.state_slot
    kv.free("a")
    assert kv.allocate(c, 2) and c.state_slot == freed
    kv.check_invariants()
    with pytest.raises(ValueError, match="exclude prefix caching"):
        KVCacheManager(16, 4, enable_prefix_caching=True, state_slots=2)
