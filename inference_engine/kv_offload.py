"""The prefix cache's second tier: full KV blocks evicted from the device pool, kept in host memory.

The device pool holds only so many blocks, so a prefix that comes back after a burst of other traffic (a
long system prompt, the history of a conversation whose user paused) has usually been evicted and would be
prefilled again. Copying a block back costs its bytes over the host link (a memcpy on the CPU engine),
far less than the prefill it replaces: this is vLLM's CPU offloading and LMCache's CPU tier.

`OffloadTier` is the tier's index, kept by the block manager beside the prefix cache and keyed the same way
(a block's tokens and everything before them): a block is stored when the device pool evicts it, restored
when a prompt's prefix misses the device but hits the tier, and dropped least recently used first. The tier
is inclusive: a restored block stays in it, so evicting it from the device again costs no copy. The copies
a step needs are handed to the runner with the step (`take_copies`) and run before its forward, stores
first (`store_blocks`, `restore_blocks`): a block taken this step is read before it is overwritten, and a
slot a restore reads this step is pinned until then, so no store of the same step overwrites it.

On the CPU engine the tier is plain memory of the same layout, not compressed: the device pool is RAM as
well, so the tier is a larger prefix cache that running sequences cannot take blocks from, and restored
blocks are bit-for-bit the ones computed (a compressed tier would change the outputs).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch

# (source, destination): (device block, slot) to store, (slot, device block) to restore
BlockCopy = tuple[int, int]

CUDA_DEFAULT_GIB = 4.0  # per rank, where the config sets no size


def tier_gib(configured: float | None, device: torch.device) -> float:
    """The tier's size: as configured, else on by default where it pays: on CUDA, where the device pool is
    small and scarce; not on the CPU, whose pool already lives in the same RAM (a larger pool is the same)."""
    if configured is not None:
        return configured
    return CUDA_DEFAULT_GIB if device.type == "cuda" else 0.0


class OffloadTier:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: OrderedDict[Hashable, int] = OrderedDict()  # key -> slot, least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.pinned: set[int] = set()  # slots the pending restores read
        self.stores: list[BlockCopy] = []
        self.restores: list[BlockCopy] = []
        self.num_stored_blocks = 0  # blocks copied into the tier, for stats
        self.num_restored_blocks = 0  # blocks copied back to the device, for stats

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.slots

    def store(self, key: Hashable, device_block: int) -> None:
        """Keeps the block the device pool is evicting; without a copy where the tier holds it already, and
        not at all where every slot is pinned."""
        if key in self.slots:
            self.slots.move_to_end(key)
            return
        slot = self._free_slot()
        if slot is None:
            return
        self.slots[key] = slot
        self.stores.append((device_block, slot))
        self.num_stored_blocks += 1

    def pin(self, key: Hashable) -> None:
        """Keeps the key's slot until the pending copies are taken: a restore of this step will read it."""
        self.slots.move_to_end(key)
        self.pinned.add(self.slots[key])

    def restore(self, key: Hashable, device_block: int) -> None:
        """Copies a pinned key's block back into `device_block` (with the step's copies)."""
        slot = self.slots[key]
        assert slot in self.pinned, "a restored slot must be pinned until the step's copies run"
        self.restores.append((slot, device_block))
        self.num_restored_blocks += 1

    def take_copies(self) -> tuple[list[BlockCopy], list[BlockCopy]]:
        """The pending (stores, restores), for the runner to perform in that order before the step's
        forward; their slots are free to be reused after."""
        copies = self.stores, self.restores
        self.stores, self.restores = [], []
        self.pinned.clear()
        return copies

    def clear(self) -> None:
        """Forgets every block, pending copies included (with the prefix cache's reset)."""
        self.slots.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.take_copies()

    def _free_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for key, slot in self.slots.items():
            if slot not in self.pinned:
                del self.slots[key]
                return slot
        return None


def store_blocks(kv_cache: torch.Tensor, tier: torch.Tensor, copies: list[BlockCopy]) -> None:
    """Copies device blocks into tier slots. `kv_cache`: [2, layers, blocks, block_size, kv_heads, head_dim]
    on the device; `tier`: [slots, 2, layers, block_size, kv_heads, head_dim] in host memory, pinned on CUDA
    so that each copy is asynchronous (the copies of one stream keep their order, so the restores issued
    after them read what they wrote)."""
    for block, slot in copies:
        tier[slot].copy_(kv_cache[:, :, block], non_blocking=True)


def restore_blocks(kv_cache: torch.Tensor, tier: torch.Tensor, copies: list[BlockCopy]) -> None:
    """Copies tier slots back into device blocks (layouts as in `store_blocks`)."""
    for slot, block in copies:
        kv_cache[:, :, block].copy_(tier[slot], non_blocking=True)
