"""The KV cache's lower tiers, host side (no JAX): the host tier's LRU, pins and step journal,
the disk tier's files (atomic, checked, per model identity, LRU, rebuilt at start), and the
copies the KV cache manager asks of the runner when the device pool evicts, when a prefix
lookup continues in the lower tiers, and at swap preemption."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxkv.core.block_pool import hash_block_tokens
from jaxkv.core.disk_tier import CorruptBlockError, DiskTier, read_block, write_block
from jaxkv.core.host_tier import HostTier
from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.request import Request
from jaxkv.sampling.params import SamplingParams

H = [hash_block_tokens(None, [i]) for i in range(10)]
ID = {"weights": "w", "dtype": "float32"}


def test_host_tier_lru_pins_and_busy_slots():
    t = HostTier(2)
    t.begin_step()
    a, _ = t.store(H[0])
    b, _ = t.store(H[1])
    assert {a, b} == {0, 1} and t.store(H[0]) == (None, None)  # already there
    assert t.store(H[2]) == (None, None)  # both slots written this step: nothing evictable
    t.begin_step()
    t.pin(H[1])
    slot, evicted = t.store(H[2])  # H[0] is the least recently used unpinned entry
    assert evicted == (H[0], a) and slot == a and t.lookup(H[0]) is None
    t.begin_step()
    assert t.store(H[3]) == (None, None) or t.lookup(H[1]) is not None  # H[1] pinned stays
    assert t.lookup(H[1]) == b
    t.unpin(H[1])
    assert t.num_pinned == 0


def test_host_tier_undo_forgets_what_the_step_stored():
    t = HostTier(3)
    t.begin_step()
    t.store(H[0])
    t.begin_step()
    t.store(H[1])
    t.pin(H[1])
    assert t.undo_step() == 1
    assert t.lookup(H[1]) is None and t.lookup(H[0]) is not None
    assert t.num_pinned == 0 and len(t.free_slots) == 2


def test_block_files_are_checked_and_atomic(tmp_path):
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones((2, 2), np.uint16)]
    p = str(tmp_path / "b.kvb")
    write_block(p, arrays)
    back = read_block(p, arrays)
    assert all((x == y).all() and x.dtype == y.dtype for x, y in zip(arrays, back))
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    raw = bytearray(open(p, "rb").read())
    raw[5] ^= 0xFF  # same size, one flipped bit pattern: the CRC catches it
    open(p, "wb").write(bytes(raw))
    with pytest.raises(CorruptBlockError, match="damaged"):
        read_block(p, arrays)
    assert not os.path.exists(p)  # deleted


def test_disk_tier_index_survives_a_restart_and_drops_bad_files(tmp_path):
    nbytes = 64
    d = DiskTier(str(tmp_path), 10 * (nbytes + 8), nbytes, ID)
    for h in H[:3]:
        write_block(d.path(d.add(h)), [np.zeros(16, np.float32)])
    open(d.path(H[1].hex()), "r+b").truncate(10)  # truncated by hand
    open(os.path.join(d.dir, "x.kvb.999999999.tmp"), "wb").write(b"half")  # a write cut short
    again = DiskTier(str(tmp_path), 10 * (nbytes + 8), nbytes, ID)
    assert again.lookup(H[0]) and again.lookup(H[2]) and not again.lookup(H[1])
    assert not os.path.exists(os.path.join(d.dir, "x.kvb.999999999.tmp"))
    other = DiskTier(str(tmp_path), 10 * (nbytes + 8), nbytes, {**ID, "dtype": "bfloat16"})
    assert other.dir != d.dir and not other.lookup(H[0])  # another model identity reads nothing


def test_disk_tier_lru_within_its_bytes(tmp_path):
    nbytes = 64
    d = DiskTier(str(tmp_path), 2 * (nbytes + 8), nbytes, ID)
    for h in H[:3]:
        d.begin_step()
        write_block(d.path(d.add(h)), [np.zeros(16, np.float32)])
    assert d.num_used == 2 and not os.path.exists(d.path(H[0].hex())) and d.num_evicted == 1


def test_disk_tier_bad_values(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_disk_bytes 10 holds no block"):
        DiskTier(str(tmp_path), 10, 64, ID)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="kv_cache_disk_dir .* is not writable"):
        DiskTier(str(blocker), 1 << 20, 64, ID)


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4), eos_token_ids=None, seed=0)


def manager(num_blocks, host_slots, disk=None):
    return KVCacheManager(num_blocks, 2, True, HostTier(host_slots), disk)


def run(kv, r, hit=(), loads=()):
    kv.begin_step()
    n = r.num_tokens - r.num_computed_tokens - (len(hit) + len(loads)) * 2
    assert kv.allocate_slots(r, n, list(hit), list(loads))
    r.num_computed_tokens = r.num_tokens
    t = kv.transfers
    kv.commit_step()
    return t


def test_device_eviction_copies_to_host_and_a_lookup_loads_it_back():
    kv = manager(5, 8)  # 4 usable device blocks of 2 tokens
    a = req("a", [1, 2, 3, 4, 5, 6])
    run(kv, a)
    kv.free(a)
    b = req("b", [7, 8, 9, 10, 11, 12, 13, 14])
    t = run(kv, b)  # takes every device block: a's three cached blocks are evicted
    assert sorted(s for _, s in t.device_to_host) == [0, 1, 2]
    assert kv.host.num_used == 3
    kv.free(b)  # b's four blocks stay cached on the device
    again = req("a2", [1, 2, 3, 4, 5, 6, 99])
    hit, n = kv.get_computed_blocks(again)
    loads = kv.get_lower_tier_hits(again, len(hit))
    assert hit == [] and len(loads) == 3  # device lost them, host has all three
    t = run(kv, again, hit, loads)
    assert len(t.host_to_device) == 3 and kv.host_hit_tokens == 6
    assert [b for _, b in t.host_to_device] == kv.get_block_ids("a2")[:3]
    # b's evicted blocks went to host in the same step: saved before the loads overwrite them
    assert {b for b, _ in t.device_to_host} & {b for _, b in t.host_to_device}


def test_a_block_registered_by_the_same_step_is_never_offloaded():
    kv = manager(3, 8)  # 2 usable blocks
    a = req("a", [1, 2, 3, 4])
    kv.begin_step()
    assert kv.allocate_slots(a, 4)
    kv.free(a)  # the step's own blocks, never written, back in the free queue
    b = req("b", [5, 6, 7, 8])
    assert kv.allocate_slots(b, 4)
    assert kv.transfers.device_to_host == []


def test_swap_out_pins_until_release_and_undo_unpins():
    kv = manager(6, 2)
    a = req("a", [1, 2, 3, 4, 5])
    run(kv, a)
    kv.begin_step()
    assert kv.swap_out(a) == 2  # two full computed blocks; the tier holds two
    assert kv.host.num_pinned == 2 and len(kv.transfers.device_to_host) == 2
    kv.free(a)
    kv.commit_step()
    kv.begin_step()
    b = req("b", [9, 9, 9, 9, 9])
    kv.swap_out(b)  # nothing computed yet: nothing swapped
    assert kv.host.num_pinned == 2
    kv.release_swapped("a")
    assert kv.host.num_pinned == 0 and kv.swapped == {"b": []}
    kv.release_swapped("b")
    kv.begin_step()
    c = req("c", [1, 2, 3, 4, 5, 6, 7])
    run(kv, c)
    kv.begin_step()
    c2 = req("c2", [11, 12, 13, 14, 15])
    kv.allocate_slots(c2, 5)
    c2.num_computed_tokens = 4
    kv.swap_out(c2)
    kv.undo_step_hashes()  # the step never ran: nothing it stored survives, pins included
    assert kv.host.num_pinned == 0


def test_an_undone_step_counts_nothing_in_the_tiers():
    kv = manager(5, 8)
    a = req("a", [1, 2, 3, 4, 5, 6])
    run(kv, a)
    kv.free(a)
    b = req("b", [7, 8, 9, 10, 11, 12, 13, 14])
    run(kv, b)  # evicts a's blocks to host
    kv.free(b)
    before = kv._tier_counters()
    kv.begin_step()
    again = req("a2", [1, 2, 3, 4, 5, 6, 99])
    hit, _ = kv.get_computed_blocks(again)
    assert kv.allocate_slots(again, 1, hit, kv.get_lower_tier_hits(again, len(hit)))
    assert kv._tier_counters() != before  # hits, loads and stores counted while scheduling
    kv.undo_step_hashes()
    assert kv._tier_counters() == before
