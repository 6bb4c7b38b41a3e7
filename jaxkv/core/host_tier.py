"""The host tier of the KV cache: slots of host memory holding full KV blocks by block hash.

Plain Python, no JAX (the runner holds the slots' arrays: jaxkv/runner/kv_offload.py). A full
block evicted from the device pool is copied here under its hash (vLLM's `--swap-space`,
`--kv-offloading-size`), and a prefix lookup that misses on the device continues here: its
blocks are copied back into free device blocks instead of being computed again. Entries are
evicted least recently used first (with a disk tier, jaxkv/core/disk_tier.py, every entry
was also written through to its file, which outlives the entry).

Swap preemption pins the entries of a preempted request until it runs again (or ends), so
that other evictions cannot push them out. Within one step no slot is written twice or
written after it is read: the runner copies in a fixed order (jaxkv.core.scheduler_output.
KVTransfers), and `busy` slots of the step are never evicted.
"""

from __future__ import annotations

from collections import OrderedDict

from .block_pool import BlockHash


class HostTier:
    """`num_slots` host slots. Errors: none; a full tier (every slot pinned or busy) stores
    nothing (store returns None) and the block is simply not kept."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.entries: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.pins: dict[BlockHash, int] = {}
        self.busy: set[int] = set()  # slots read or written by the step being scheduled
        self.stored_this_step: list[BlockHash] = []
        self.num_stored = self.num_loaded = 0  # blocks device -> host / host -> device
        self.num_evicted = 0

    @property
    def max_blocks(self) -> int:
        """The tier's capacity in blocks (as DiskTier.max_blocks)."""
        return self.num_slots

    @property
    def num_used(self) -> int:
        return len(self.entries)

    @property
    def num_pinned(self) -> int:
        return len(self.pins)

    def begin_step(self) -> None:
        self.busy = set()
        self.stored_this_step = []

    def lookup(self, h: BlockHash) -> int | None:
        """The slot holding block `h` (now most recently used), or None."""
        slot = self.entries.get(h)
        if slot is not None:
            self.entries.move_to_end(h)
        return slot

    def load(self, h: BlockHash) -> int:
        """Block `h` is read into the device this step: its slot, kept until the step ran."""
        slot = self.entries[h]
        self.busy.add(slot)
        self.num_loaded += 1
        return slot

    def store(self, h: BlockHash) -> tuple[int | None, tuple[BlockHash, int] | None]:
        """A slot for block `h` (written this step), evicting the least recently used entry
        that is neither pinned nor busy when the tier is full. Returns (slot, evicted), slot
        None when `h` is already here or nothing can be evicted; `evicted` is the (hash,
        slot) whose old contents the runner must save first (for the disk tier), or None."""
        if h in self.entries:
            self.entries.move_to_end(h)
            return None, None
        evicted = None
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((v for v, s in self.entries.items()
                           if v not in self.pins and s not in self.busy), None)
            if victim is None:
                return None, None
            slot = self.entries.pop(victim)
            evicted = (victim, slot)
            self.num_evicted += 1
        self.entries[h] = slot
        self.busy.add(slot)
        self.stored_this_step.append(h)
        self.num_stored += 1
        return slot, evicted

    def pin(self, h: BlockHash) -> None:
        self.pins[h] = self.pins.get(h, 0) + 1

    def unpin(self, h: BlockHash) -> None:
        n = self.pins.get(h, 0) - 1
        if n > 0:
            self.pins[h] = n
        else:
            self.pins.pop(h, None)

    def undo_step(self) -> int:
        """The step did not run: forget what it stored (never written). Returns how many."""
        for h in self.stored_this_step:
            slot = self.entries.pop(h, None)
            if slot is not None:
                self.free_slots.append(slot)
            self.pins.pop(h, None)
        n, self.stored_this_step = len(self.stored_this_step), []
        return n

    def reset(self) -> int:
        """Forget every unpinned entry; returns how many."""
        drop = [h for h in self.entries if h not in self.pins]
        for h in drop:
            self.free_slots.append(self.entries.pop(h))
        return len(drop)
