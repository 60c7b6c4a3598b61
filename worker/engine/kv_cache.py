"""Paged KV cache bookkeeping: which block holds which tokens of which request.

Block/slot arithmetic (block_size = 4 shown; default 16):

    request tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    block table:     [   7       ,    2        ,   11 ]        (non-contiguous physical blocks)
    slot of t9:      block_table[9 // 4] * 4 + 9 % 4 = 11 * 4 + 1 = 45

The BlockPool owns ref counts and the prefix-cache map; the KVCacheManager owns the
per-request block tables and is the only caller of the pool (single writer). Only
the Scheduler calls the manager. Prefix caching follows vLLM's automatic prefix
caching: a full block is keyed by a chained hash of (parent hash, namespace salt,
block tokens), so equal prefixes share blocks; blocks are registered only once their
KV is computed, and a freed registered block stays evictable ("cached") until reused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from worker.engine.kv_host import HostKVIndex, KVCopy
from worker.engine.outputs import KVStats

if TYPE_CHECKING:
    from worker.engine.request import Request

NULL_BLOCK = -1  # a block-table entry whose block was freed (behind a sliding window)


def hash_block(parent_hash: bytes, salt: bytes, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: 16 bytes of BLAKE2b over parent, salt and tokens."""
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """Ref counts, free queue and prefix-cache map of `num_blocks` physical KV blocks.

    A block is *used* (ref > 0), *cached* (ref == 0, holds a registered hash, evictable)
    or *free* (ref == 0, no hash). Free and cached blocks sit in one LRU queue; taking
    a cached block evicts its hash (`on_evict(block_id, hash)` is told first: the host
    tier's save, `kv_host.py`). Writer: KVCacheManager.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictable = 0  # ref == 0 blocks that hold a hash
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be taken now (free + evictable cached)."""
        return len(self._free)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def take(self, n: int) -> list[int] | None:
        """Take `n` blocks with ref 1, least recently freed first; None if fewer are left."""
        if n > len(self._free):
            return None
        taken = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            old_hash = self.block_hash[block_id]
            if old_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block_id, old_hash)
                del self._cached[old_hash]
                self.block_hash[block_id] = None
                self.num_evictable -= 1
            self.ref_cnt[block_id] = 1
            taken.append(block_id)
        return taken

    def touch(self, block_ids: list[int]) -> None:
        """Add a reference to each (cache hit); revives evictable blocks."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
                if self.block_hash[block_id] is not None:
                    self.num_evictable -= 1
            self.ref_cnt[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop a reference to each. Tail blocks are queued first so they are evicted first."""
        for block_id in reversed(block_ids):
            ref = self.ref_cnt[block_id] - 1
            if ref < 0:
                raise RuntimeError(f"KV block {block_id} released with ref count 0")
            self.ref_cnt[block_id] = ref
            if ref == 0:
                self._free[block_id] = None
                if self.block_hash[block_id] is not None:
                    self.num_evictable += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Publish a computed full block under its hash (first writer wins)."""
        if block_hash in self._cached or self.block_hash[block_id] is not None:
            return
        self._cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash


class KVCacheManager:
    """Per-request block tables over one BlockPool.

    Args:
        num_blocks: physical blocks in the cache (the engine's KV capacity / block_size).
        block_size: tokens per block.
        enable_prefix_caching: share computed full blocks between equal prefixes.
        namespace: salt mixed into every block hash (model id), so caches of different
            models never match; requests add their own salt (tenant).
        host_slots: blocks of the host-memory tier behind the prefix cache (`kv_host.py`);
            0: none. Needs prefix caching.
        state_slots: recurrent-state slots of the model (`worker.model.recurrent`; 0: none):
            a request takes one with its first blocks (`Request.state_slot`) and gives it
            back with them, so a request that holds blocks holds a slot. A state is not a
            set of blocks, so it excludes prefix caching.

    Raises:
        ValueError: a host tier without prefix caching; state slots with prefix caching.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, namespace: bytes = b"",
        host_slots: int = 0, state_slots: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self._tenants: dict[str, str] = {}  # request id -> tenant, while it has a block table
        self._num_held: dict[str, int] = {}  # tenant -> block-table entries of its requests
        self.host: HostKVIndex | None = None
        if host_slots:
            if not enable_prefix_caching:
                raise ValueError("a host KV tier needs prefix caching (it keeps evicted prefix blocks)")
            self.host = HostKVIndex(host_slots)
            self.pool.on_evict = self.host.evicted
        if state_slots and enable_prefix_caching:
            raise ValueError("recurrent-state slots exclude prefix caching (a prefix's state is not a set of blocks)")
        self._free_state_slots: list[int] | None = list(range(state_slots - 1, -1, -1)) if state_slots else None
        self._state_slots: dict[str, int] = {}  # request id -> its state slot, while it has a block table

    # Whether a running request's block table may change other than by appending (a
    # sliding window frees behind in place): then a step launched ahead needs its own copy.
    # Appends and a freed request's table (dropped, never cleared) are safe to share.
    changes_tables_in_place = False

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def tables(self) -> dict[str, list[int]]:
        """Every request's block table by id (read-only: `allocate` and `free` write them)."""
        return self._block_tables

    def block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids in token order (do not mutate)."""
        return self._block_tables.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _extend_hashes(self, req: Request, num_full_blocks: int) -> None:
        hashes = req.block_hashes
        bs = self.block_size
        tokens = req.all_token_ids
        salt = self.namespace + req.cache_salt
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, salt, tokens[i * bs : (i + 1) * bs]))

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks of the longest cached prefix of `req` (not yet referenced).

        At most `(num_tokens - 1) // block_size` blocks, so at least one token is left
        to compute and sample from (as vLLM). With a host tier, the prefix goes on through
        blocks found there: each is restored into a fresh device block (a load recorded
        for the next step, the block registered under its hash), when the pool can hold
        them and the rest of the prompt (else the prefix stops at the device's hits).
        """
        if not self.enable_prefix_caching or req.request_id in self._block_tables:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        hits = []
        hashes = req.block_hashes
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.host is not None and len(hits) < max_blocks:
            hits += self._restore_from_host(req, hits, hashes[len(hits):max_blocks])
        return hits

    def _restore_from_host(self, req: Request, hits: list[int], hashes: list[bytes]) -> list[int]:
        """Device blocks restored from the host tier for the hashes after the device's
        `hits` (as far as the tier holds them in a row); [] when the pool, with `hits`
        pinned, cannot hold them and the rest of the prompt."""
        host = self.host
        found = host.find(hashes)  # slots in a row, now the tier's most recently used
        if not found:
            return []
        pool = self.pool
        pool.touch(hits)  # pinned: the blocks taken below must not be the device's own hits
        restored: list[int] = []
        try:
            if pool.num_free_blocks < self.num_blocks_for(req.num_tokens) - len(hits):
                return []
            for slot, block_hash in zip(found, hashes):
                block_id = pool.take(1)[0]  # checked above; may evict (and save) a device block
                if host.slot_hash[slot] != block_hash:  # that save took this very slot: the
                    pool.release([block_id])  # tier held nothing but this prefix; stop here
                    break
                pool.register(block_id, block_hash)
                host.restore(slot, block_id, block_hash)
                restored.append(block_id)
            pool.release(restored)  # cached, unreferenced, as a device hit is
            return restored
        finally:
            pool.release(hits)

    def take_copies(self) -> list[KVCopy]:
        """Host-tier copies recorded since the last call, in order; the step that carries
        them runs them before its forward (`kv_host.py`). [] without a host tier."""
        return self.host.take_copies() if self.host is not None and self.host.has_copies else []

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + evictable cached)."""
        return self.pool.num_free_blocks

    def _num_tokens_to_cover(self, req: Request, num_new: int, num_cached_blocks: int, reserve_tokens: int) -> int:
        if req.request_id in self._block_tables:
            return max(req.num_computed_tokens + num_new, reserve_tokens)
        return max(num_cached_blocks * self.block_size + num_new, reserve_tokens)

    def num_blocks_to_allocate(
        self,
        req: Request,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        reserve_tokens: int = 0,
    ) -> int:
        """Pool blocks that `allocate` with the same arguments would take: new blocks
        plus evictable cached blocks it revives (0 if the table already covers it)."""
        table = self._block_tables.get(req.request_id)
        cached_blocks = [] if table is not None else cached_blocks or []
        num_have = len(table) if table is not None else len(cached_blocks)
        num_tokens = self._num_tokens_to_cover(req, num_new_tokens, len(cached_blocks), reserve_tokens)
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_cnt[b] == 0)
        return max(self.num_blocks_for(num_tokens) - num_have, 0) + num_revived

    def num_blocks_to_admit(self, req: Request, num_prefill: int, cached_blocks: list[int],
                            reserve_tokens: int = 0) -> int:
        """Blocks that must be free to admit `req` with `num_prefill` tokens left to
        compute: the whole remaining prefill (and the reservation), so a long prompt is not
        started on a chunk that fits only to lose its blocks before its prefill ends."""
        return self.num_blocks_to_allocate(req, num_prefill, cached_blocks, reserve_tokens)

    def admission_tokens(self, num_prefill: int, budget: int) -> int:
        """Tokens the admission's `allocate` covers: the whole remaining prefill."""
        return num_prefill

    def table_growth(
        self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None, reserve_tokens: int = 0
    ) -> int:
        """Entries `allocate` with the same arguments would add to the request's block
        table (cached blocks included): what it adds to its tenant's `num_blocks_held`."""
        table = self._block_tables.get(req.request_id)
        num_cached = 0 if table is not None else len(cached_blocks or ())
        num_tokens = self._num_tokens_to_cover(req, num_new_tokens, num_cached, reserve_tokens)
        return max(self.num_blocks_for(num_tokens) - (len(table) if table is not None else 0), 0)

    def num_blocks_held(self, tenant: str) -> int:
        """Block-table entries of the tenant's requests (a block shared by two of its
        requests counts twice; prefix blocks are shared only within a tenant's salt)."""
        return self._num_held.get(tenant, 0)

    def num_freeable_blocks(self, request_id: str) -> int:
        """Blocks that freeing the request would give back to the pool (those only it references)."""
        ref_cnt = self.pool.ref_cnt
        return sum(1 for b in self._block_tables.get(request_id, ()) if b != NULL_BLOCK and ref_cnt[b] == 1)

    def allocate(
        self,
        req: Request,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        reserve_tokens: int = 0,
    ) -> bool:
        """Make the block table of `req` cover its computed tokens + `num_new_tokens`
        (and at least `reserve_tokens`). `cached_blocks` (from `find_cached_prefix`)
        are prepended on a request's first allocation.

        Returns False, changing nothing, if not enough blocks are free.
        """
        table = self._block_tables.get(req.request_id)
        if table is not None:  # a running request's next chunk: no prefix to revive, no cached blocks
            num_tokens = max(req.num_computed_tokens + num_new_tokens, reserve_tokens)
            num_new_blocks = -(-num_tokens // self.block_size) - len(table)
            if num_new_blocks <= 0:
                return True  # the usual decode: its last block has room
            new_blocks = self.pool.take(num_new_blocks)
            if new_blocks is None:
                return False
            table.extend(new_blocks)
            self._num_held[req.tenant] = self._num_held.get(req.tenant, 0) + num_new_blocks
            return True
        num_needed = self.num_blocks_to_allocate(req, num_new_tokens, cached_blocks, reserve_tokens)
        if num_needed > self.pool.num_free_blocks:
            return False
        if not self._take_state_slot(req):
            return False
        cached_blocks = cached_blocks or []
        num_tokens = self._num_tokens_to_cover(req, num_new_tokens, len(cached_blocks), reserve_tokens)
        table = list(cached_blocks)
        self._block_tables[req.request_id] = table
        self._num_registered[req.request_id] = len(cached_blocks)
        self._tenants[req.request_id] = req.tenant
        self.pool.touch(cached_blocks)
        num_new_blocks = self.num_blocks_for(num_tokens) - len(table)
        if num_new_blocks > 0:
            new_blocks = self.pool.take(num_new_blocks)
            assert new_blocks is not None  # checked above
            table.extend(new_blocks)
        if table:
            self._num_held[req.tenant] = self._num_held.get(req.tenant, 0) + len(table)
        return True

    def _take_state_slot(self, req: Request) -> bool:
        """A new table's recurrent-state slot (`state_slots`), taken for `req`; False when every
        slot is held (nothing taken). True without slots."""
        if self._free_state_slots is None:
            return True
        if not self._free_state_slots:
            return False
        req.state_slot = self._state_slots[req.request_id] = self._free_state_slots.pop()
        return True

    def cache_full_blocks(self, req: Request, num_computed: int | None = None) -> None:
        """Register the request's newly computed full blocks in the prefix cache: those
        below `num_computed` (tokens whose KV a finished forward wrote; default
        `req.num_computed_tokens`)."""
        if not self.enable_prefix_caching:
            return
        num_full = (req.num_computed_tokens if num_computed is None else num_computed) // self.block_size
        start = self._num_registered[req.request_id]
        if num_full <= start:
            return
        self._extend_hashes(req, num_full)
        table = self._block_tables[req.request_id]
        for i in range(start, num_full):
            if table[i] != NULL_BLOCK:
                self.pool.register(table[i], req.block_hashes[i])
        self._num_registered[req.request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release every block of the request; no-op for unknown ids."""
        table = self._block_tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if self._free_state_slots is not None and request_id in self._state_slots:
            self._free_state_slots.append(self._state_slots.pop(request_id))
        tenant = self._tenants.pop(request_id, None)
        live = [b for b in table if b != NULL_BLOCK] if table else None
        if live:
            self.pool.release(live)
            held = self._num_held[tenant] - len(live)
            if held:
                self._num_held[tenant] = held
            else:
                del self._num_held[tenant]

    def stats(self) -> KVStats:
        pool = self.pool
        free_or_cached = pool.num_free_blocks
        return KVStats(
            total_blocks=pool.num_blocks,
            used_blocks=pool.num_blocks - free_or_cached,
            free_blocks=free_or_cached - pool.num_evictable,
            cached_blocks=pool.num_evictable,
            block_size=self.block_size,
            host_blocks=self.host.num_slots if self.host is not None else 0,
            host_used_blocks=self.host.num_used if self.host is not None else 0,
        )

    def check_invariants(self) -> None:
        """Recount everything from the block tables; raise RuntimeError with the numbers on mismatch."""
        pool = self.pool
        expected = [0] * pool.num_blocks
        for table in self._block_tables.values():
            for block_id in table:
                if block_id != NULL_BLOCK:
                    expected[block_id] += 1
        if expected != pool.ref_cnt:
            bad = [i for i in range(pool.num_blocks) if expected[i] != pool.ref_cnt[i]][:5]
            raise RuntimeError(
                f"KV ref counts disagree with block tables at blocks {bad}: "
                f"tables say {[expected[i] for i in bad]}, pool says {[pool.ref_cnt[i] for i in bad]}"
            )
        num_zero = sum(1 for r in pool.ref_cnt if r == 0)
        if num_zero != pool.num_free_blocks:
            raise RuntimeError(f"{num_zero} blocks have ref 0 but the free queue holds {pool.num_free_blocks}")
        num_evictable = sum(1 for b in pool._free if pool.block_hash[b] is not None)
        if num_evictable != pool.num_evictable:
            raise RuntimeError(f"evictable count {pool.num_evictable} != {num_evictable} counted")
        held: dict[str, int] = {}
        for rid, table in self._block_tables.items():
            num_live = sum(1 for b in table if b != NULL_BLOCK)
            if num_live:
                held[self._tenants[rid]] = held.get(self._tenants[rid], 0) + num_live
        if held != self._num_held:
            raise RuntimeError(f"blocks held per tenant {self._num_held} != {held} counted from the tables")
        if self._free_state_slots is not None:
            held_slots = sorted(self._state_slots.values())
            if set(self._state_slots) != set(self._block_tables) or len(set(held_slots)) != len(held_slots) or \
                    set(held_slots) & set(self._free_state_slots):
                raise RuntimeError(f"state slots held {self._state_slots} / free {self._free_state_slots} disagree "
                                   f"with the block tables of {sorted(self._block_tables)}")
        s = self.stats()
        if s.free_blocks + s.used_blocks + s.cached_blocks != s.total_blocks:
            raise RuntimeError(f"free {s.free_blocks} + used {s.used_blocks} + cached {s.cached_blocks} != {s.total_blocks}")
