"""The paged KV-cache allocator (PagedAttention's block manager).

KV memory is a pool of fixed-size blocks; each sequence maps its logical blocks to physical ones
through its block table and grows one block at a time, so at most one partly filled block per
sequence is ever wasted. Blocks are reference-counted: forked samples (n > 1) share their prompt's
blocks and copy a shared partial block on first write, and with prefix caching every full block is
registered under a hash of its tokens and everything before them, so later requests that start the
same way reuse it. Blocks nobody references stay cached until the pool needs them, least recently
used first. With a second tier (`kv_offload`), a cached block the pool evicts is kept in host memory and
copied back when a later prompt's prefix reaches it, instead of being prefilled again.
"""

from __future__ import annotations

from collections import OrderedDict

from inference_engine.kv_offload import BlockCopy, OffloadTier
from inference_engine.sequence import Sequence

BlockKey = tuple[int, tuple[int, ...]]  # (hash of the previous block's key, this block's tokens)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
        num_offload_blocks: int = 0,
    ) -> None:
        """`num_cpu_blocks`: swap space for preempted sequences; `num_offload_blocks`: slots of the prefix
        cache's second tier (0: none)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        # Unreferenced blocks in eviction order (front first); cached ones sit behind the blank ones.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockKey, int] = {}
        self.num_cache_queries = 0  # prompt tokens looked up in the prefix cache, for stats
        self.num_cache_hits = 0  # tokens served from the prefix cache, for stats
        # Swap space: CPU blocks that hold the KV of preempted sequences until they resume.
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu = list(range(num_cpu_blocks))
        self.tier = OffloadTier(num_offload_blocks) if num_offload_blocks and enable_prefix_caching else None
        self.num_offload_queries = 0  # prompt tokens looked up in the tier (past the device's hits)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks `append_slots` would take, counting a copy-on-write of a shared last block."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        needed = max(0, total - len(seq.block_table))
        if seq.num_computed_tokens % self.block_size and self.ref_counts[seq.block_table[-1]] > 1:
            needed += 1
        return needed

    def can_append(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_new_tokens) + reserve <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Makes room for the next tokens; returns (src, dst) block copies the cache must perform first."""
        copies = []
        if seq.num_computed_tokens % self.block_size and self.ref_counts[seq.block_table[-1]] > 1:
            shared = seq.block_table[-1]
            self.ref_counts[shared] -= 1
            seq.block_table[-1] = self._take()
            seq.block_table_version += 1
            copies.append((shared, seq.block_table[-1]))
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take())
        return copies

    def match_prefix(self, seq: Sequence) -> int:
        """Points a new sequence at cached blocks for its leading full blocks; returns tokens reused.

        Blocks the device pool evicted but the second tier holds get fresh device blocks, restored from the
        tier with the step's copies (`take_offload_copies`), as long as free blocks last. The last token is
        always recomputed (its logits are needed), so its block is never matched.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        self.num_cache_queries += len(seq.token_ids)
        chain: list[tuple[BlockKey, int | None]] = []  # (key, device block; None where the tier holds it)
        parent = _root(seq)
        for start in range(0, len(seq.token_ids) - self.block_size, self.block_size):
            key = (parent, tuple(seq.token_ids[start : start + self.block_size]))
            block = self.cached.get(key)
            if block is None and (self.tier is None or key not in self.tier):
                break
            chain.append((key, block))
            parent = hash(key)
        # Device hits are referenced first, so that the blocks taken for tier hits cannot evict them.
        spare = len(self.free) - sum(1 for _, b in chain if b is not None and self.ref_counts[b] == 0)
        for i, (_, block) in enumerate(chain):
            if block is None:
                spare -= 1
                if spare < 0:
                    del chain[i:]
                    break
        for key, block in chain:
            if block is None:
                self.tier.pin(key)
                continue
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        device_hits = 0
        for key, block in chain:
            if block is None:
                block = self._take()
                self.tier.restore(key, block)
                self.block_keys[block], self.cached[key] = key, block
            else:
                device_hits += self.block_size
            seq.block_table.append(block)
            seq.block_hashes.append(hash(key))
        reused = len(seq.block_table) * self.block_size
        if self.tier is not None:
            self.num_offload_queries += len(seq.token_ids) - device_hits
        seq.num_computed_tokens = seq.num_cached_tokens = reused
        self.num_cache_hits += device_hits
        return reused

    def take_offload_copies(self) -> tuple[list[BlockCopy], list[BlockCopy]]:
        """The second tier's pending (stores, restores) for the runner to perform before the next forward."""
        return self.tier.take_copies() if self.tier is not None else ([], [])

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publishes blocks whose every slot now holds computed K/V, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            parent = seq.block_hashes[-1] if seq.block_hashes else _root(seq)
            key = (parent, tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size]))
            seq.block_hashes.append(hash(key))
            block = seq.block_table[i]
            if key not in self.cached and self.block_keys[block] is None:  # else someone cached it first
                self.block_keys[block] = key
                self.cached[key] = block

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Returns the blocks past the first `num_tokens` slots (taken for rejected draft tokens)."""
        keep = -(-num_tokens // self.block_size)
        for block in seq.block_table[keep:]:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                self.free.move_to_end(block, last=False)  # never cached: blank, reused first
        if keep < len(seq.block_table):
            del seq.block_table[keep:]
            seq.block_table_version += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        for block in child.block_table:
            self.ref_counts[block] += 1

    def free_seq(self, seq: Sequence) -> None:
        # Release the tail first: it is evicted before the prefix, which other requests are likelier to share.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.block_keys[block] is None:
                    self.free.move_to_end(block, last=False)
        seq.block_table = []
        seq.block_hashes = []
        seq.block_table_version += 1

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.free_cpu)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Moves a sequence's KV to CPU blocks; returns (device block, cpu block) copies to perform."""
        seq.cpu_block_table = [self.free_cpu.pop() for _ in seq.block_table]
        copies = list(zip(seq.block_table, seq.cpu_block_table, strict=True))
        self.free_seq(seq)
        return copies

    def can_swap_in(self, seq: Sequence, reserve: int = 0) -> bool:
        # One block of headroom for the token the resumed sequence computes next.
        return len(seq.cpu_block_table) + 1 + reserve <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Brings a swapped sequence back into fresh device blocks; returns (cpu, device) block copies."""
        seq.block_table = [self._take() for _ in seq.cpu_block_table]
        copies = list(zip(seq.cpu_block_table, seq.block_table, strict=True))
        self.free_cpu_blocks(seq)
        return copies

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, as vLLM's reset_prefix_cache (e.g. between benchmark runs);
        refused (False) while any sequence holds blocks."""
        if len(self.free) != self.num_blocks:
            return False
        self.cached.clear()
        self.block_keys = [None] * self.num_blocks
        if self.tier is not None:
            self.tier.clear()
        return True

    def free_cpu_blocks(self, seq: Sequence) -> None:
        self.free_cpu.extend(seq.cpu_block_table)
        seq.cpu_block_table = []

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:
            del self.cached[key]
            self.block_keys[block] = None
            if self.tier is not None:
                self.tier.store(key, block)
        self.ref_counts[block] = 1
        return block


def _root(seq: Sequence) -> int:
    """The parent hash of a sequence's first block: its LoRA adapter's, so that blocks of the same tokens
    computed under different adapters (different K/V) never match; 0 for the base model."""
    lora_id = seq.group.lora_int_id
    return hash(("lora", lora_id)) if lora_id else 0
