"""The host-memory KV tier's tensors and its block copies (`serving_tuning.host_kv_bytes`;
the bookkeeping, and why the copies' order is the whole correctness argument, are in
`worker.engine.kv_host`).

One host tensor per device cache tensor — each layer's key and value caches, and their
int8 scales where the KV is int8 — with `num_slots` rows where the device tensor has
`num_blocks`: `[num_slots, block_size, num_kv_heads, head_dim]` beside
`[num_blocks, block_size, num_kv_heads, head_dim]`. A latent (MLA) layer's value is a
view of its key, so it is copied once. In pinned memory on CUDA.

A step's copies run on the thread that runs its forward, before it, in the recorded
order. On the CPU they run in batches that give the same result (`copy_batches`): one
`index_select` / `index_copy_` per tensor for a batch's saves, one for its loads. On CUDA each block is one asynchronous
copy on the forward's stream (pinned memory both ways): the stream orders it against the
forwards before and after it, and the host never reads a slot a pending copy writes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from worker.engine.kv_host import KVCopy, KVCopyError


class CopyBatch(NamedTuple):
    """Copies that run as one batched copy each way: the saves first, then the loads."""

    save_blocks: list[int]
    save_slots: list[int]
    load_slots: list[int]
    load_blocks: list[int]


def copy_batches(copies: Sequence[KVCopy]) -> list[CopyBatch]:
    """`copies` grouped into batches that give the same result as running them in order:
    a copy joins the open batch unless running it there (saves before loads) would change
    what some copy reads or writes — a save of a block the batch loads into, a save into
    a slot the batch loads from, or a destination written twice — else it opens the next.
    An eviction taking a block for a restore makes copies alternate save, load, save, ...
    on different blocks and slots: one batch."""
    batches: list[CopyBatch] = []
    loaded: set[int] = set()  # blocks the open batch loads into
    read: set[int] = set()  # slots it loads from
    saved: set[int] = set()  # slots it saves into
    for c in copies:
        if c.to_host:
            joins = c.block_id not in loaded and c.slot not in read and c.slot not in saved
        else:
            joins = c.block_id not in loaded
        if not batches or not joins:
            batches.append(CopyBatch([], [], [], []))
            loaded, read, saved = set(), set(), set()
        batch = batches[-1]
        if c.to_host:
            batch.save_blocks.append(c.block_id)
            batch.save_slots.append(c.slot)
            saved.add(c.slot)
        else:
            batch.load_slots.append(c.slot)
            batch.load_blocks.append(c.block_id)
            loaded.add(c.block_id)
            read.add(c.slot)
    return batches


class HostKVBuffers:
    """Host copies of KV blocks for the device caches `tensors` (each `[num_blocks, ...]`).

    Args:
        tensors: the device cache tensors, each indexed by block id in dim 0 (views that
            share storage with another listed tensor must be left out).
        num_slots: host blocks.
        per_block: copy block by block (CUDA's way) even on the CPU (tests).

    `bytes_per_slot`: host bytes of one block over all tensors. `copy_s`, `bytes_saved`,
    `bytes_loaded`: cumulative seconds spent copying (on CUDA: queuing the copies) and bytes
    moved each way. `slot_hash`: the hash of the block each slot was last saved from, as
    the copies ran (not as the bookkeeping planned them): every load is checked against it.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], num_slots: int, per_block: bool | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one slot, got {num_slots}")
        self.device_tensors = list(tensors)
        pin = any(t.is_cuda for t in self.device_tensors)
        self.host_tensors = [torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
                             for t in self.device_tensors]
        self.num_slots = num_slots
        self.per_block = pin if per_block is None else per_block
        self.bytes_per_slot = sum(h[0].numel() * h.element_size() for h in self.host_tensors)
        self.copy_s = 0.0
        self.bytes_saved = 0
        self.bytes_loaded = 0
        self.slot_hash: list[bytes | None] = [None] * num_slots

    def apply(self, copies: Sequence[KVCopy]) -> None:
        """Run `copies` in order.

        Raises:
            KVCopyError: a load of a slot that holds another block than the load names
                (nothing copied), or a copy failed (from whatever torch raised).
        """
        if not copies:
            return
        saved: dict[int, bytes] = {}  # slot -> hash, saved by these copies so far
        for c in copies:  # the hash check, in order, before any byte moves
            if c.to_host:
                saved[c.slot] = c.block_hash
            elif (held := saved.get(c.slot, self.slot_hash[c.slot])) != c.block_hash:
                raise KVCopyError(f"host KV slot {c.slot} holds block {held!r}, a load into device block "
                                  f"{c.block_id} expects {c.block_hash!r}")
        t0 = time.perf_counter()
        try:
            if self.per_block:
                self._apply_per_block(copies)
            else:
                self._apply_batched(copies)
        except Exception as e:
            raise KVCopyError(f"host KV copy of {len(copies)} blocks failed: {type(e).__name__}: {e}") from e
        finally:
            self.copy_s += time.perf_counter() - t0
        for slot, block_hash in saved.items():
            self.slot_hash[slot] = block_hash
        num_saved = sum(1 for c in copies if c.to_host)
        self.bytes_saved += num_saved * self.bytes_per_slot
        self.bytes_loaded += (len(copies) - num_saved) * self.bytes_per_slot

    def _apply_batched(self, copies: Sequence[KVCopy]) -> None:
        device = self.device_tensors[0].device
        for batch in copy_batches(copies):
            if batch.save_blocks:
                blocks, slots = torch.tensor(batch.save_blocks, device=device), torch.tensor(batch.save_slots)
                for dev, host in zip(self.device_tensors, self.host_tensors):
                    host.index_copy_(0, slots, dev.index_select(0, blocks).to(host.device))
            if batch.load_blocks:
                blocks, slots = torch.tensor(batch.load_blocks, device=device), torch.tensor(batch.load_slots)
                for dev, host in zip(self.device_tensors, self.host_tensors):
                    dev.index_copy_(0, blocks, host.index_select(0, slots).to(dev.device))

    def _apply_per_block(self, copies: Sequence[KVCopy]) -> None:
        for c in copies:
            for dev, host in zip(self.device_tensors, self.host_tensors):
                if c.to_host:
                    host[c.slot].copy_(dev[c.block_id], non_blocking=True)
                else:
                    dev[c.block_id].copy_(host[c.slot], non_blocking=True)


def cache_tensors(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
                  kv_scales: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None) -> list[torch.Tensor]:
    """The device tensors a block lives in: each layer's key and value caches (the value
    left out where it is a view of the key: latent attention) and their int8 scales."""
    out: list[torch.Tensor] = []
    for layer in kv_caches:
        if layer is None:
            continue
        k, v = layer
        out.append(k)
        if v.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
            out.append(v)
    for scales in kv_scales or ():
        if scales is not None:
            out.extend(scales)
    return out
