"""Host-memory KV tier: a second, larger prefix cache behind the device's
(`serving_tuning.host_kv_bytes`; vLLM's KV offloading, SGLang's HiCache, LMCache).

The device's prefix cache keeps a freed full block *cached* until its block is taken for
new tokens (`BlockPool.take`). With a host tier, that eviction first copies the block's
KV to a host slot, keyed by the block's hash; a later prefix lookup that misses on the
device but finds the hash here takes a fresh device block, copies the slot back into it
and registers it on the device again, so the prefix is restored instead of recomputed.
The hash chain (parent hash, model namespace, tenant and adapter salts, tokens) is the
device cache's, unchanged: a hit here is exactly a hit there.

This module is bookkeeping only (the scheduler's side, one thread): which slot holds which
hash, least recently used first, and the copies the next step must run. The runner owns
the host tensors and runs the copies (`worker.model.host_kv.HostKVBuffers`).

**Order.** Copies are recorded in the order the bookkeeping decided them and run in that
order, all before the forward of the step that carries them (`SchedulerOutput.kv_copies`;
a step that schedules nothing carries none: they wait for the next one). That order is
the whole correctness argument:
  - a block evicted now is written first by a step built from now on, so saving it before
    that step's forward reads the content it was registered with (steps run one after
    another; an earlier step in flight never writes a registered block);
  - a restored block is read first by a step built from now on (it is registered now, its
    load is recorded now), so loading it before that step's forward is in time;
  - a slot or a block reused within the recorded list (saved, then loaded into again; a
    slot loaded from, then given to another hash) sees each copy in turn.
A copy that fails leaves blocks registered without their content, so it is not a forward
failure to retry around: the runner raises `KVCopyError` and the engine core stops.

The tier is inclusive: a restored block stays in its slot, so evicting it again from the
device costs no copy.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class KVCopy(NamedTuple):
    """One block copy between the device cache and the host tier: `to_host` (a save,
    device block -> host slot) or not (a load, host slot -> device block), of the block
    whose prefix hash is `block_hash` (the runner checks a load against what it saved)."""

    to_host: bool
    block_id: int
    slot: int
    block_hash: bytes


class KVCopyError(RuntimeError):
    """Copying blocks between the device cache and the host tier failed: blocks are
    registered whose content is not where the bookkeeping says. Not retried; the engine
    core stops (the worker's crash handling hands its jobs back)."""


class HostKVIndex:
    """Slots of the host tier by block hash, least recently used first, and the copies
    recorded since the last step took them.

    Args:
        num_slots: host blocks (`host_kv_bytes` / the bytes of one device block).

    Counters (cumulative, read by the engine's step stats): `num_saved` and `num_loaded`
    blocks copied each way (each load is one block a prefix lookup found here).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"HostKVIndex needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slot_hash: list[bytes | None] = [None] * num_slots
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._copies: list[KVCopy] = []
        self.num_saved = 0
        self.num_loaded = 0

    @property
    def num_used(self) -> int:
        return len(self._slots)

    def find(self, hashes: list[bytes]) -> list[int]:
        """Slots of the leading `hashes` the tier holds in a row (a prefix's next blocks),
        each made the most recently used, so saves recorded next take other slots first."""
        slots = []
        for block_hash in hashes:
            slot = self._slots.get(block_hash)
            if slot is None:
                break
            self._slots.move_to_end(block_hash)
            slots.append(slot)
        return slots

    def evicted(self, block_id: int, block_hash: bytes) -> None:
        """The device is about to reuse `block_id`, which holds `block_hash`: keep a copy
        (a save recorded, into a free slot or the least recently used one), unless the
        tier holds that hash already (then it only becomes the most recently used)."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slots.popitem(last=False)
            self.slot_hash[slot] = None
        self._slots[block_hash] = slot
        self.slot_hash[slot] = block_hash
        self._copies.append(KVCopy(True, block_id, slot, block_hash))
        self.num_saved += 1

    def restore(self, slot: int, block_id: int, block_hash: bytes) -> None:
        """Record a load of `slot` into the fresh device block `block_id`.

        Raises:
            KVCopyError: the slot does not hold `block_hash` (the index is corrupt).
        """
        if self.slot_hash[slot] != block_hash:
            raise KVCopyError(f"host KV slot {slot} holds {self.slot_hash[slot]!r}, not the block {block_hash!r} "
                              "a lookup found there")
        self._slots.move_to_end(block_hash)
        self._copies.append(KVCopy(False, block_id, slot, block_hash))
        self.num_loaded += 1

    def take_copies(self) -> list[KVCopy]:
        """The copies recorded since the last call, in order (the caller's step runs them)."""
        copies, self._copies = self._copies, []
        return copies

    @property
    def has_copies(self) -> bool:
        return bool(self._copies)
