"""KV cache manager: block tables per request, prefix-cache lookup, allocation, freeing, forks.

Plain Python, no JAX. Follows vLLM V1's KVCacheManager: full blocks are hashed as
hash(parent hash, block token ids) and registered as soon as the step that fills them is
scheduled, so a request scheduled later in the same step can already hit them (the runner
writes every token's K/V before any attention of that layer reads the cache).

Registrations of the step being scheduled are journalled (`begin_step`): if that step never
runs (the runner raised, Ctrl-C), `undo_step_hashes` forgets them, so no block whose K/V was
never written is ever served from the prefix cache. `commit_step` keeps them once it ran.

With the lower tiers (`host`, jaxkv/core/host_tier.py; `disk`, jaxkv/core/disk_tier.py) a
full block evicted from the device pool is copied to host memory under its hash (and written
through to disk), a prefix lookup continues in host memory and on disk
after its last device hit, and swap preemption (`swap_out`) copies a preempted request's
blocks to host memory, pinned until it runs again. The copies of a step are collected in
`transfers` (jaxkv.core.scheduler_output.KVTransfers), which the runner makes before the step.

With `sliding_window` (a model whose every layer is windowed; the largest window) the blocks
a request's next query can no longer see are freed as it advances (vLLM's
SlidingWindowManager.remove_skipped_blocks): their places in its block table become the null
block, which attention masks as out of the window. They keep their hashes in the free queue,
so a prefix hit can still take them until they are evicted.
"""

from __future__ import annotations

from .block_pool import BlockHash, BlockPool, hash_block_tokens
from .disk_tier import DiskTier
from .host_tier import HostTier
from .request import Request
from .scheduler_output import KVTransfers


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 host: HostTier | None = None, disk: DiskTier | None = None,
                 sliding_window: int | None = None):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_window_freed_blocks = 0  # blocks freed behind the sliding window so far
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._step_cached: list[int] = []  # blocks registered by the step being scheduled
        self.host, self.disk = host, disk
        self.transfers = KVTransfers()
        self.swapped: dict[str, list[BlockHash]] = {}  # swapped-out request -> pinned hashes
        self.host_hit_tokens = self.disk_hit_tokens = 0  # prompt tokens found in each tier
        self._step_counters = None  # the tier counters when the step being scheduled began
        if host is not None:
            self.pool.on_evict = self._offload

    # ---- step journal -------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start journalling the hash registrations (and tier copies) of a new step."""
        self._step_cached = []
        self.transfers = KVTransfers()
        for tier in (self.host, self.disk):
            if tier is not None:
                tier.begin_step()
        self._step_counters = self._tier_counters()

    def _tier_counters(self) -> tuple:
        return (self.host_hit_tokens, self.disk_hit_tokens,
                *((t.num_stored, t.num_loaded, t.num_evicted) for t in (self.host, self.disk)
                  if t is not None))

    def _restore_tier_counters(self, saved: tuple) -> None:
        self.host_hit_tokens, self.disk_hit_tokens = saved[0], saved[1]
        for tier, counts in zip((t for t in (self.host, self.disk) if t is not None), saved[2:]):
            tier.num_stored, tier.num_loaded, tier.num_evicted = counts

    def commit_step(self) -> None:
        """The step ran: its blocks hold the K/V their hashes promise."""
        self._step_cached = []

    def undo_step_hashes(self) -> int:
        """The step did not run: forget the hashes it registered (and the host-tier entries
        it would have written). Returns how many device hashes."""
        for bid in self._step_cached:
            self.pool.uncache_block(bid)
        n, self._step_cached = len(self._step_cached), []
        if self.host is not None:
            self.host.undo_step()
        if self.disk is not None:
            self.disk.undo_step()
        if getattr(self, "_step_counters", None) is not None:  # the step's counts never happened
            self._restore_tier_counters(self._step_counters)
        self.transfers = KVTransfers()
        return n

    # ---- lower tiers ----------------------------------------------------------------------
    def _host_slot(self, h: BlockHash) -> int | None:
        """A host slot to write block `h` into this step (None: already there, or the tier is
        full of pinned and busy entries). With a disk tier the block is also written through
        to its file, so the disk holds every block the host tier took (and keeps it after the
        host tier evicts it, and across restarts)."""
        slot, _ = self.host.store(h)
        if slot is not None and self.disk is not None:
            name = self.disk.add(h)
            if name is not None:
                self.transfers.host_to_disk.append((slot, name))
        return slot

    def _offload(self, block_id: int, h: BlockHash) -> None:
        """The device pool evicts a cached block: keep its contents in host memory (unless the
        step being scheduled registered it: its K/V are not written yet)."""
        if block_id in self._step_cached:
            return
        slot = self._host_slot(h)
        if slot is not None:
            self.transfers.device_to_host.append((block_id, slot))

    def swap_out(self, req: Request) -> int:
        """Swap preemption: copy `req`'s computed full blocks to host memory and pin them there
        until it runs again (release_swapped). Stops at the first block the tier cannot take:
        the rest is computed again. Call before its blocks are freed. Returns blocks kept."""
        blocks = self.req_to_blocks.get(req.request_id, [])
        self._update_block_hashes(req)
        n = min(req.num_computed_tokens // self.block_size, len(blocks), len(req.block_hashes))
        pinned = self.swapped.setdefault(req.request_id, [])
        for bid, h in zip(blocks[:n], req.block_hashes[:n]):
            if bid == 0 or bid in self._step_cached:  # freed behind the window, or unwritten
                break
            if self.host.lookup(h) is None:
                slot = self._host_slot(h)
                if slot is None:
                    break
                self.transfers.device_to_host.append((bid, slot))
            self.host.pin(h)
            pinned.append(h)
        return len(pinned)

    def release_swapped(self, request_id: str) -> None:
        """Unpin a swapped-out request's host blocks (it runs again, or ended)."""
        for h in self.swapped.pop(request_id, []):
            self.host.unpin(h)

    # ---- prefix cache -------------------------------------------------------------------
    def _update_block_hashes(self, req: Request) -> None:
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), req.num_tokens // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block_tokens(parent, req.all_token_ids[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks on the device that prefixes `req`'s tokens.

        Returns (block ids, number of tokens they hold). The hit never covers the last token:
        it must be computed to produce logits. Requests asking for prompt_logprobs get no hit
        (their whole prompt is computed). The scheduler counts the lookup once the request is
        admitted (record_prefix_lookup).
        """
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit = []
        for h in req.block_hashes[:max_blocks]:
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hit.append(bid)
        return hit, len(hit) * self.block_size

    def get_lower_tier_hits(self, req: Request, num_device_hits: int) -> list[BlockHash]:
        """The run of `req`'s blocks after its `num_device_hits` device hits that host memory
        or the disk hold (their hashes, to pass to allocate_slots as `loads`); same limits as
        get_computed_blocks. Empty without lower tiers."""
        if self.host is None or not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        loads = []
        for h in req.block_hashes[num_device_hits:max_blocks]:
            if self.host.lookup(h) is None and not (self.disk is not None and self.disk.lookup(h)):
                break
            loads.append(h)
        return loads

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one admitted request's lookup (prompt tokens asked for / found)."""
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    # ---- allocation ---------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, new_computed_blocks: list[int] = (),
                       loads: list[BlockHash] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after req.num_computed_tokens (plus the
        tokens of `new_computed_blocks`, a prefix hit taken now, and of `loads`, hits in the
        lower tiers copied into new blocks this step). Returns False, changing nothing, when
        the free queue cannot cover it (the scheduler then preempts)."""
        if not new_computed_blocks and not loads and self.sliding_window is None:
            blocks = self.req_to_blocks.get(req.request_id)  # the steady decode step's case:
            total = req.num_computed_tokens + num_new_tokens  # room in the blocks it holds
            if blocks is not None and total <= len(blocks) * self.block_size:
                self._cache_full_blocks(req, min(total, req.num_tokens))
                return True
        self.remove_skipped_blocks(req)
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + (len(new_computed_blocks) + len(loads)) * self.block_size
        new_computed_blocks, loads, behind = self._skip_hits_behind_window(
            num_computed, len(blocks), new_computed_blocks, loads)
        total = num_computed + num_new_tokens
        num_new_blocks = (cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks)
                          - behind)
        # Cached blocks with no holder sit in the free queue: taking them uses free capacity.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b and self.pool.blocks[b].ref_cnt == 0)
        if max(num_new_blocks, 0) + num_evictable_hits > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[req.request_id]
            return False
        # Where each load comes from, fixed before any eviction below could push it out.
        sources = [("host", self.host.load(h)) if self.host.lookup(h) is not None
                   else ("disk", self.disk.load(h)) for h in loads]
        if new_computed_blocks or behind:
            self.pool.touch([b for b in new_computed_blocks if b])
            blocks.extend(list(new_computed_blocks) + [0] * behind)
            self.num_cached_blocks[req.request_id] = len(blocks)
        first_load = len(blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        for (tier, src), bid in zip(sources, blocks[first_load:]):
            if tier == "host":
                self.transfers.host_to_device.append((src, bid))
                self.host_hit_tokens += self.block_size
            else:
                self.transfers.disk_to_device.append((src, bid))
                self.disk_hit_tokens += self.block_size
        # Only the request's own tokens are hashed, never a draft (speculative decoding).
        self._cache_full_blocks(req, min(total, req.num_tokens))
        return True

    def _skip_hits_behind_window(self, num_computed: int, held: int, hits: list[int],
                                 loads: list[BlockHash]) -> tuple:
        """With a sliding window, the prefix hits (device blocks, then lower-tier loads) that
        lie wholly behind the window of the next token at `num_computed` are not taken: device
        hits become the null block, loads are dropped and counted (their entries become the
        null block too). Returns (hits, loads, loads dropped)."""
        if self.sliding_window is None:
            return hits, loads, 0
        behind = max(num_computed - self.sliding_window + 1, 0) // self.block_size - held
        skip = min(max(behind, 0), len(hits))
        dropped = min(max(behind - skip, 0), len(loads))
        return [0] * skip + list(hits[skip:]), list(loads[dropped:]), dropped

    def remove_skipped_blocks(self, req: Request) -> int:
        """Free `req`'s blocks wholly before its sliding window: the next token, at position
        req.num_computed_tokens, sees keys from num_computed_tokens - sliding_window + 1 on.
        Their block-table entries become the null block 0; newest first, so the free queue
        evicts them before the older blocks a prefix chain starts with. Returns how many."""
        blocks = self.req_to_blocks.get(req.request_id)
        if self.sliding_window is None or not blocks:
            return 0
        pos = req.num_computed_tokens  # (or where n > 1 samples still have to fork)
        if req.fork_position is not None:
            pos = min(pos, req.fork_position)
        first_needed = max(pos - self.sliding_window + 1, 0) // self.block_size
        freed = []
        for i in range(min(first_needed, len(blocks)) - 1, -1, -1):
            if blocks[i] == 0:  # freed before, and so is everything in front of it
                break
            freed.append(blocks[i])
            blocks[i] = 0
        self.pool.free_blocks(freed)
        self.num_window_freed_blocks += len(freed)
        return len(freed)

    def blocks_to_hold(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once: all of them, or
        with a sliding window those the window and one step's `max_step_tokens` span."""
        n = cdiv(num_tokens, self.block_size)
        if self.sliding_window is None:
            return n
        return min(n, cdiv(self.sliding_window - 1 + max_step_tokens, self.block_size) + 1)

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        start = self.num_cached_blocks.get(req.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        self._update_block_hashes(req)
        blocks = self.req_to_blocks[req.request_id]
        for i in range(start, end):  # a block freed behind the window unhashed (drafts): none
            if blocks[i] and self.pool.cache_block(blocks[i], req.block_hashes[i]):
                self._step_cached.append(blocks[i])
        self.num_cached_blocks[req.request_id] = end

    def fork(self, parent: Request, child: Request, num_blocks: int) -> None:
        """Share the first `num_blocks` (full, computed) blocks of `parent` with `child` (n > 1)."""
        shared = self.req_to_blocks[parent.request_id][:num_blocks]
        self.pool.touch([b for b in shared if b])  # not the null block (behind the window)
        self.req_to_blocks[child.request_id] = list(shared)
        self.num_cached_blocks[child.request_id] = num_blocks
        child.block_hashes = list(parent.block_hashes[:num_blocks])

    def trim(self, req: Request, num_tokens: int) -> int:
        """Free `req`'s blocks past those holding its first `num_tokens` tokens (after rejected
        draft tokens: those blocks hold only rejected positions and were never hashed). They
        go to the front of the free queue, so the next draft takes them back instead of
        evicting a cached block. Returns how many were freed."""
        blocks = self.req_to_blocks.get(req.request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        extra = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(extra, front=True)
        return len(extra)

    def free(self, req: Request) -> None:
        """Release every block of `req`, tail first (so its tail is evicted before its head)."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        self.pool.free_blocks([b for b in reversed(blocks) if b])  # null: freed behind the window

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, as vLLM: refused (False, nothing dropped) while any
        request holds blocks, since those blocks would lose their hashes mid-use. The host
        tier forgets its unpinned entries too; the disk tier is kept (it outlives restarts)."""
        if self.pool.num_used_blocks:
            return False
        self.pool.reset_prefix_cache()
        if self.host is not None:
            self.host.reset()
        return True

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total_blocks
