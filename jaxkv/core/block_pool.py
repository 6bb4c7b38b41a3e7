"""Physical KV blocks: free queue in LRU order, reference counts, and the prefix-cache map.

Plain Python, no JAX. Follows vLLM V1's BlockPool: block 0 is the null block that padding
rows point at and is never handed out; the free queue starts in order 1..N-1; a block whose
ref count drops to 0 keeps its hash and stays cached in the free queue until it is evicted,
least recently freed first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids, extra_keys: tuple = ()) -> BlockHash:
    """Hash of one full block: sha256(parent hash, token ids[, extra keys]).

    SHA-256 over the parent's digest and the token ids as int64 bytes, so two different prefixes
    collide only with cryptographic improbability (vLLM's `sha256` prefix-caching hash).
    """
    h = hashlib.sha256()
    h.update(parent_hash or b"\x00" * 32)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = field(default=None)


class BlockPool:
    """All `num_blocks` blocks of the KV pool (block 0 reserved as the null block).

    Errors: `get_new_blocks` raises RuntimeError when asked for more blocks than are free
    (callers check `num_free_blocks` first).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        # OrderedDict gives O(1) removal from the middle (a prefix hit on a free cached block)
        # and O(1) pop of the least recently freed block from the front.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[BlockHash, int] = {}
        # Called as on_evict(block_id, block_hash) when get_new_blocks evicts a cached block
        # (the KV cache manager keeps it in a lower tier); None: it is just dropped.
        self.on_evict = None

    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop n blocks from the front of the free queue (evicting their cached hashes)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            blk = self.blocks[bid]
            if self.on_evict is not None and blk.block_hash is not None \
                    and self.cached.get(blk.block_hash) == bid:
                self.on_evict(bid, blk.block_hash)
            self._evict(blk)
            blk.ref_cnt = 1
            out.append(bid)
        return out

    def _evict(self, blk: KVBlock) -> None:
        if blk.block_hash is not None:
            if self.cached.get(blk.block_hash) == blk.block_id:
                del self.cached[blk.block_hash]
            blk.block_hash = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free queue."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0:
                del self.free_queue[bid]
            blk.ref_cnt += 1

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full block under its hash (first writer wins; duplicates stay uncached).
        Returns whether it was registered now."""
        if not self.enable_caching:
            return False
        blk = self.blocks[block_id]
        if blk.block_hash is not None:
            return False
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
            blk.block_hash = block_hash
            return True
        return False

    def uncache_block(self, block_id: int) -> None:
        """Forget a block's hash (its contents can no longer be trusted); it stays allocated."""
        self._evict(self.blocks[block_id])

    def free_blocks(self, block_ids, front: bool = False) -> None:
        """Drop one reference from each block, in the order given; blocks reaching 0 join the
        back of the free queue (callers pass a request's blocks tail first, so tails are
        evicted before the shared heads), or with `front` its front: blocks holding nothing
        worth keeping (rejected draft positions) are reused before any cached block."""
        for bid in block_ids:
            blk = self.blocks[bid]
            assert blk.ref_cnt > 0 and bid != 0, f"double free of block {bid}"
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self.free_queue[bid] = None
                if front:
                    self.free_queue.move_to_end(bid, last=False)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds (the null block not counted)."""
        return self.num_total_blocks - self.num_free_blocks

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash of a block no request holds; returns how many were dropped."""
        dropped = 0
        for bid in self.free_queue:
            blk = self.blocks[bid]
            if blk.block_hash is not None:
                self._evict(blk)
                dropped += 1
        return dropped
