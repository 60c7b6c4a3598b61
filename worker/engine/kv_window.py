"""KV blocks for a model whose every attention layer reads only the last W positions
(Mistral with `sliding_window`, Phi-3 and StarCoder2 windowed checkpoints, Qwen2 with
all layers windowed): blocks no future query can read are freed as the request advances,
so a request holds about W tokens of KV however long it runs (vLLM's
`SlidingWindowManager` does the same). Models with both full and windowed layers keep
whole block tables (`KVCacheManager`): their full layers read everything.

Block arithmetic (block_size 4, W = 6), the next query at position 13:

    positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13
    keys read                   ↑ 8 .. 13 (13 - W + 1 = 8)
    table       [ -1    ,  -1     ,  b8       ,  b12  ]     blocks 0 and 1 freed (NULL_BLOCK)

A chunk of C new tokens starting at s reads positions `[s - W + 1, s + C)`: at most
`W - 1 + C` positions, on at most one block more than they fill, hence `peak_blocks`.
Freeing happens at the start of every `allocate` of the request (each step it is
scheduled), before new blocks are taken, so a decode that crosses into a new block
usually gives one back in the same call.

Reservations. Under `kv_policy: reserve` (and for a request preempted twice) a request
must never need a block it cannot get. Here that is a *promise* of `peak_blocks` of its
whole length: the blocks it does not hold yet are counted as taken for everyone else
(`num_free_blocks` excludes every promise), blocks it frees behind the window go back to
the pool and to its promise, blocks it takes come out of it. So a reserved windowed
request holds about W tokens, never more than its promise, and always gets its blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.engine.kv_cache import NULL_BLOCK, KVCacheManager

if TYPE_CHECKING:
    from worker.engine.request import Request


def peak_blocks(num_tokens: int, window: int, block_size: int, max_chunk: int) -> int:
    """Most blocks a request of `num_tokens` positions holds at once when every layer
    reads the last `window` positions and no chunk exceeds `max_chunk` tokens
    (a decode: `ceil(W / block_size) + 1`, the window plus one block)."""
    span = window - 1 + min(max_chunk, num_tokens)
    return min(-(-num_tokens // block_size), -(-span // block_size) + 1)


class SlidingWindowKVCacheManager(KVCacheManager):
    """`KVCacheManager` for all-windowed models (see the module docstring).

    Args:
        sliding_window: W, the positions every layer reads.
        max_chunk: the step token budget (`max_batched_tokens`): the longest chunk.
    """

    changes_tables_in_place = True  # freeing behind writes NULL_BLOCK over a table's first entries

    def __init__(self, num_blocks: int, block_size: int, *, sliding_window: int, max_chunk: int,
                 enable_prefix_caching: bool = True, namespace: bytes = b"", state_slots: int = 0) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, namespace, state_slots=state_slots)
        self.sliding_window = sliding_window
        self.max_chunk = max_chunk
        self._num_skipped: dict[str, int] = {}  # leading NULL_BLOCK entries per table
        self._promised: dict[str, int] = {}  # reserved requests: blocks still promised
        self._num_promised = 0

    def peak_blocks(self, num_tokens: int) -> int:
        return peak_blocks(num_tokens, self.sliding_window, self.block_size, self.max_chunk)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation without a promise can take now."""
        return self.pool.num_free_blocks - self._num_promised

    def num_blocks_to_allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None,
                               reserve_tokens: int = 0) -> int:
        if req.request_id in self._block_tables:  # freeing behind comes first: an upper bound
            table = self._block_tables[req.request_id]
            return max(self.num_blocks_for(req.num_computed_tokens + num_new_tokens) - len(table), 0)
        cached = cached_blocks or []
        num_revived = sum(1 for b in cached if self.pool.ref_cnt[b] == 0)
        num_new = max(self.num_blocks_for(len(cached) * self.block_size + num_new_tokens) - len(cached), 0)
        promise = self.peak_blocks(reserve_tokens) if reserve_tokens else 0
        return max(num_new + num_revived, promise)

    def num_blocks_to_admit(self, req: Request, num_prefill: int, cached_blocks: list[int],
                            reserve_tokens: int = 0) -> int:
        """The peak of the remaining prefill (or the promise, when reserved): what the
        request will hold at once, not its whole length."""
        need = self.peak_blocks(req.num_tokens)
        return max(need, self.peak_blocks(reserve_tokens) if reserve_tokens else 0)

    def admission_tokens(self, num_prefill: int, budget: int) -> int:
        """Only the first chunk: later chunks free behind as they take blocks ahead."""
        return min(num_prefill, budget)

    def table_growth(self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None,
                     reserve_tokens: int = 0) -> int:
        table = self._block_tables.get(req.request_id)
        if table is None:
            cached = cached_blocks or []
            return max(self.num_blocks_for(len(cached) * self.block_size + num_new_tokens), len(cached))
        return max(self.num_blocks_for(req.num_computed_tokens + num_new_tokens) - len(table), 0)

    def num_freeable_blocks(self, request_id: str) -> int:
        return super().num_freeable_blocks(request_id) + self._promised.get(request_id, 0)

    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None,
                 reserve_tokens: int = 0) -> bool:
        """Free what the window left behind, then cover the computed tokens + `num_new_tokens`.
        On a first allocation with `reserve_tokens`, promise `peak_blocks(reserve_tokens)`.
        Returns False, changing nothing but the freeing, if the blocks are not free."""
        rid = req.request_id
        table = self._block_tables.get(rid)
        if table is not None:
            self._free_behind(req, table)
            num_new = self.num_blocks_for(req.num_computed_tokens + num_new_tokens) - len(table)
            if num_new <= 0:
                return True
            if num_new > self.num_free_blocks + self._promised.get(rid, 0):
                return False
            self._take(req, table, num_new)
            return True
        cached = cached_blocks or []
        num_needed = self.num_blocks_to_allocate(req, num_new_tokens, cached, reserve_tokens)
        if num_needed > self.num_free_blocks or not self._take_state_slot(req):
            return False
        num_revived = sum(1 for b in cached if self.pool.ref_cnt[b] == 0)
        table = []
        self._block_tables[rid] = table
        self._num_registered[rid] = len(cached)
        self._tenants[rid] = req.tenant
        self.pool.touch(cached)
        table.extend(cached)
        self._num_held[req.tenant] = self._num_held.get(req.tenant, 0) + len(cached)
        if reserve_tokens:
            num_exclusive = num_revived  # cached blocks others hold cost this request nothing
            self._promised[rid] = promise = max(self.peak_blocks(reserve_tokens) - num_exclusive, 0)
            self._num_promised += promise
        num_new = self.num_blocks_for(len(cached) * self.block_size + num_new_tokens) - len(table)
        if num_new > 0:
            self._take(req, table, num_new)
        self._free_behind(req, table)
        return True

    def _take(self, req: Request, table: list[int], n: int) -> None:
        promised = self._promised.get(req.request_id)
        if promised is not None:
            used = min(n, promised)
            self._promised[req.request_id] = promised - used
            self._num_promised -= used
        blocks = self.pool.take(n)
        assert blocks is not None  # checked by the caller
        table.extend(blocks)
        self._num_held[req.tenant] = self._num_held.get(req.tenant, 0) + n

    def _free_behind(self, req: Request, table: list[int]) -> None:
        """Release the blocks entirely before the first position the next query reads."""
        rid = req.request_id
        first_read = req.num_computed_tokens - self.sliding_window + 1
        end = min(max(first_read, 0) // self.block_size, len(table))
        start = self._num_skipped.get(rid, 0)
        if end <= start:
            return
        freed = [b for b in table[start:end] if b != NULL_BLOCK]
        returned = sum(1 for b in freed if self.pool.ref_cnt[b] == 1)
        for i in range(start, end):
            table[i] = NULL_BLOCK
        self._num_skipped[rid] = end
        if freed:
            self.pool.release(freed)
            held = self._num_held[req.tenant] - len(freed)
            if held:
                self._num_held[req.tenant] = held
            else:
                del self._num_held[req.tenant]
        if rid in self._promised and returned:
            self._promised[rid] += returned
            self._num_promised += returned

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its table without the freed entries)."""
        return sum(1 for b in self._block_tables.get(request_id, ()) if b != NULL_BLOCK)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._num_skipped.pop(request_id, None)
        self._num_promised -= self._promised.pop(request_id, 0)

    def check_invariants(self) -> None:
        super().check_invariants()
        if self._num_promised != sum(self._promised.values()) or self._num_promised > self.pool.num_free_blocks:
            raise RuntimeError(f"{self._num_promised} blocks promised ({sum(self._promised.values())} counted), "
                               f"{self.pool.num_free_blocks} free")
