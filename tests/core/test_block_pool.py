"""Block pool and KV cache manager with tiny pools and exact block ids."""

import random

import pytest

from jaxkv.core.block_pool import BlockPool
from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.request import Request
from jaxkv.sampling.params import SamplingParams


def req(rid, ids, **sp):
    return Request(rid, list(ids), SamplingParams(**sp), eos_token_ids=None, seed=0)


def test_free_queue_starts_in_order_and_null_block_is_reserved():
    pool = BlockPool(6)
    assert pool.num_total_blocks == 5 and pool.num_free_blocks == 5
    assert pool.get_new_blocks(3) == [1, 2, 3]
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)


def test_allocate_free_and_ref_counts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(10))
    assert kv.allocate_slots(a, 10)
    assert kv.get_block_ids("a") == [1, 2, 3]
    a.num_computed_tokens = 10
    a.append_output_token(99)
    assert kv.allocate_slots(a, 1)  # token 11 still fits block 3
    assert kv.get_block_ids("a") == [1, 2, 3]
    for t in range(2):
        a.num_computed_tokens += 1
        a.append_output_token(100 + t)
    assert kv.allocate_slots(a, 1)  # 13th token opens block 4
    assert kv.get_block_ids("a") == [1, 2, 3, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 1, 1]
    kv.free(a)
    assert kv.num_free_blocks == 7
    # Freed tail first: the free queue now ends with 4, 3, 2, 1 (tail evicted before head).
    assert list(kv.pool.free_queue)[-4:] == [4, 3, 2, 1]


def test_allocation_fails_cleanly_when_pool_is_short():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", range(8))
    assert kv.allocate_slots(a, 8)
    b = req("b", range(100, 108))
    assert not kv.allocate_slots(b, 8)  # needs 2, one free
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1


def test_prefix_hit_shares_blocks_and_is_capped_before_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", range(12))  # exactly 3 full blocks
    assert kv.allocate_slots(a, 12)
    b = req("b", range(12))  # same tokens: the hit must leave the last token to compute
    hit, n = kv.get_computed_blocks(b)
    assert hit == [1, 2] and n == 8
    assert kv.allocate_slots(b, 4, hit)
    assert kv.get_block_ids("b")[:2] == [1, 2] and kv.get_block_ids("b")[2] != 3
    assert kv.pool.blocks[1].ref_cnt == 2 and kv.pool.blocks[3].ref_cnt == 1
    c = req("c", list(range(8)) + [50, 51, 52, 53, 54])  # shares two blocks, then diverges
    hit, n = kv.get_computed_blocks(c)
    assert hit == [1, 2] and n == 8


def test_cached_free_blocks_are_hit_then_evicted_lru():
    kv = KVCacheManager(num_blocks=5, block_size=2)  # 4 usable blocks
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)  # blocks 1, 2, 3 (two full, hashed)
    kv.free(a)
    assert kv.num_free_blocks == 4  # cached blocks count as free
    b = req("b", [1, 2, 3, 4, 9])
    hit, n = kv.get_computed_blocks(b)
    assert hit == [1, 2] and n == 4
    assert kv.allocate_slots(b, 1, hit)
    assert kv.num_free_blocks == 1
    kv.free(b)
    # Queue now: 3 (a's tail, freed first), then b's blocks tail first: 4, 2, 1.
    # A fresh 6-token request takes the three least recently freed blocks.
    c = req("c", [7, 7, 7, 7, 7, 7])
    assert kv.allocate_slots(c, 6)
    assert kv.get_block_ids("c") == [3, 4, 2]
    # Block 1 (a's head) is the only cached survivor.
    d = req("d", [1, 2, 3, 4, 5])
    hit, _ = kv.get_computed_blocks(d)
    assert hit == [1]


def test_reset_prefix_cache_is_refused_while_blocks_are_held():
    # vLLM's rule: resetting while a request holds blocks returns False and drops nothing.
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    b = req("b", [6, 7, 8, 9, 1])
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 5)
    kv.free(a)
    assert kv.reset_prefix_cache() is False
    assert kv.get_computed_blocks(req("a2", [1, 2, 3, 4, 5]))[1] == 4
    assert kv.get_computed_blocks(req("b2", [6, 7, 8, 9, 1]))[1] == 4
    kv.free(b)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(req("a2", [1, 2, 3, 4, 5]))[1] == 0
    assert kv.get_computed_blocks(req("b2", [6, 7, 8, 9, 1]))[1] == 0


def test_no_hits_when_caching_disabled_or_prompt_logprobs():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == ([], 0)
    kv2 = KVCacheManager(num_blocks=8, block_size=2)
    assert kv2.allocate_slots(req("a", [1, 2, 3, 4, 5]), 5)
    assert kv2.get_computed_blocks(req("b", [1, 2, 3, 4, 5], prompt_logprobs=1)) == ([], 0)


def test_fork_shares_full_prompt_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    p = req("p", range(10))
    assert kv.allocate_slots(p, 10)
    c = req("c", range(10))
    kv.fork(p, c, 2)
    assert kv.get_block_ids("c") == [1, 2]
    assert kv.pool.blocks[1].ref_cnt == 2
    kv.free(p)
    kv.free(c)
    assert kv.num_free_blocks == 9


def test_random_mix_of_finished_and_aborted_requests_frees_everything():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=40, block_size=4)
    live = []
    base = list(range(30))
    for i in range(300):
        if live and rng.random() < 0.45:
            kv.free(live.pop(rng.randrange(len(live))))
            continue
        n = rng.randint(1, 30)
        r = req(f"r{i}", base[:rng.randint(0, 20)] + [rng.randint(100, 200) for _ in range(n)])
        hit, nh = kv.get_computed_blocks(r)
        if kv.allocate_slots(r, r.num_tokens - nh, hit):
            live.append(r)
        for bid in range(1, 40):
            b = kv.pool.blocks[bid]
            assert (b.ref_cnt == 0) == (bid in kv.pool.free_queue)
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == kv.num_total_blocks == 39
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in range(1, 40))


def test_blocks_behind_a_sliding_window_are_freed_and_keep_their_hashes():
    """Window 6, blocks of 4: the token at position p sees p - 5 .. p, so block i is freed once
    the next position passes 4 i + 9; its block-table entry becomes the null block 0."""
    kv = KVCacheManager(num_blocks=8, block_size=4, sliding_window=6)
    a = req("a", range(12))
    assert kv.allocate_slots(a, 12) and kv.get_block_ids("a") == [1, 2, 3]
    a.num_computed_tokens = 12
    a.append_output_token(50)
    assert kv.allocate_slots(a, 1)  # next position 12 sees 7..12: block 0 (tokens 0..3) goes
    assert kv.get_block_ids("a") == [0, 2, 3, 4] and kv.num_window_freed_blocks == 1
    assert kv.pool.blocks[1].ref_cnt == 0 and kv.pool.blocks[1].block_hash is not None
    b = req("b", range(12))  # the freed block is still a prefix hit until evicted
    assert kv.get_computed_blocks(b) == ([1, 2], 8)
    for t in range(4):
        a.num_computed_tokens += 1
        a.append_output_token(60 + t)
        assert kv.allocate_slots(a, 1)
    assert kv.get_block_ids("a") == [0, 0, 3, 4, 5]  # next position 16 sees 11..16
    c = req("c", list(range(12)) + [7])  # a hit of 3 blocks; the first is behind c's window
    hit, n = kv.get_computed_blocks(c)
    assert (hit, n) == ([1, 2, 3], 12) and kv.allocate_slots(c, 1, hit)
    assert kv.get_block_ids("c") == [0, 2, 3, 6] and kv.pool.blocks[1].ref_cnt == 0
    kv.free(a)
    kv.free(c)
    assert kv.num_free_blocks == kv.num_total_blocks
    # A request holds at most the blocks its window and one step's tokens span.
    assert kv.blocks_to_hold(100, 8) == 5 and kv.blocks_to_hold(10, 8) == 3
    assert KVCacheManager(8, 4).blocks_to_hold(100, 8) == 25
    assert KVCacheManager(8, 4).remove_skipped_blocks(a) == 0  # no window: nothing freed


def test_fork_and_swap_out_skip_blocks_freed_behind_the_window():
    from jaxkv.core.host_tier import HostTier
    kv = KVCacheManager(num_blocks=10, block_size=4, sliding_window=3,
                        host=HostTier(8))
    a = req("a", range(13))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 5) and kv.get_block_ids("a") == [0, 2, 3, 4]
    a.num_computed_tokens = 13
    child = req("c", range(13))
    kv.fork(a, child, 3)
    assert kv.get_block_ids("c") == [0, 2, 3] and kv.pool.blocks[0].ref_cnt == 1
    assert kv.swap_out(a) == 0  # its first block is gone: nothing to keep, all recomputed
    kv.free(child)
    kv.free(a)
    assert kv.num_free_blocks == kv.num_total_blocks and kv.pool.blocks[0].ref_cnt == 1


def test_sliding_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        KVCacheManager(8, 4, sliding_window=0)


def test_a_block_freed_behind_the_window_before_it_was_hashed_gets_no_hash():
    """Window 7, blocks of 4: a draft of 8 tokens all accepted moves the sequence past block 1
    before its tokens were its own (drafts are never hashed); it is freed unhashed, and the
    null block that takes its place is never registered under its hash."""
    kv = KVCacheManager(num_blocks=12, block_size=4, sliding_window=7)
    a = req("a", range(5))
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    a.append_output_token(100)
    assert kv.allocate_slots(a, 9)  # 1 + 8 draft tokens at positions 5..13
    a.num_computed_tokens = 14
    for t in range(101, 110):
        a.append_output_token(t)
    assert kv.allocate_slots(a, 1)
    assert kv.get_block_ids("a")[:2] == [0, 0] and kv.pool.blocks[0].block_hash is None
    assert 0 not in kv.pool.cached.values()
    hit, _ = kv.get_computed_blocks(req("b", list(range(5)) + list(range(100, 110))))
    assert 0 not in hit


def test_host_tier_hits_behind_the_window_are_not_loaded():
    """A sequence longer than the device pool, computed once (its blocks went to host memory
    as they were evicted), comes again: the host hits behind its window become null entries
    instead of blocks to load, so it fits the pool again."""
    from jaxkv.core.host_tier import HostTier
    kv = KVCacheManager(num_blocks=5, block_size=4, sliding_window=5, host=HostTier(16))
    a = req("a", range(30))
    for start in range(0, 28, 4):  # computed in chunks of 4: at most 3 blocks held
        kv.begin_step()
        a.num_computed_tokens = start
        assert kv.allocate_slots(a, 4)
        kv.commit_step()
    kv.free(a)
    b = req("b", range(30))
    hit, n = kv.get_computed_blocks(b)
    loads = kv.get_lower_tier_hits(b, len(hit))
    assert not hit and len(loads) == 3  # blocks 0-2 were evicted to host memory
    kv.begin_step()
    assert kv.allocate_slots(b, 2, hit, loads)  # next position 12 sees 8..12: blocks 0, 1 not
    table = kv.get_block_ids("b")
    assert table[:2] == [0, 0] and 0 not in table[2:] and len(table) == 4
    assert len(kv.transfers.host_to_device) == 1 and kv.host_hit_tokens == 4
    kv.free(b)
    assert kv.num_free_blocks == kv.num_total_blocks
