"""The runner's side of the KV tiers: the host tier's arrays, and the copies of one step.

The host tier is one numpy array per leaf of the KV pool (jaxkv/attention/kv_pool.py), each
[num_host_blocks, num_layers, block_size, ...] in the pool's storage dtype: a slot holds one
whole block of every layer, contiguous (what the disk tier writes as one file). A step's
copies (jaxkv.core.scheduler_output.KVTransfers) are made before the step, in one batch per
direction: one jitted gather of the device blocks to save (read back to host memory), the
new host entries written through to their files, then one jitted scatter of the blocks to load (from host slots and
files) into the pool, which is donated to it and updated in place, never copied whole. The
block counts are padded to powers of two (with the null block 0, whose contents nobody reads)
so that a few small programs serve every step.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core.disk_tier import SUFFIX, CorruptBlockError, read_block, write_block
from jaxkv.runner.buckets import pow2_at_least

logger = logging.getLogger("jaxkv")


class KVOffload:
    """kv_cache: the pool (its leaves' shapes and dtypes, and shardings with a mesh);
    num_host_blocks: host tier slots; disk_dir: the disk tier's folder of this model identity
    (jaxkv.core.disk_tier.DiskTier.dir), or None."""

    def __init__(self, kv_cache, num_host_blocks: int, disk_dir: str | None = None):
        leaves, self.treedef = jax.tree.flatten(kv_cache)
        self.host = [np.zeros((num_host_blocks, x.shape[0], *x.shape[2:]), x.dtype) for x in leaves]
        self.disk_dir = disk_dir
        self.write_errors = 0
        self.block_nbytes = sum(h[0].nbytes for h in self.host)
        shardings = [x.sharding for x in leaves]

        def gather(pool, ids):
            return [jnp.moveaxis(x[:, ids], 1, 0) for x in jax.tree.leaves(pool)]

        def scatter(pool, ids, data):
            new = [x.at[:, ids].set(jnp.moveaxis(d, 0, 1)) for x, d in zip(jax.tree.leaves(pool), data)]
            return jax.tree.unflatten(self.treedef, new)
        self._gather = jax.jit(gather)
        self._scatter = jax.jit(scatter, donate_argnums=(0,),
                                out_shardings=jax.tree.unflatten(self.treedef, shardings))

    def _path(self, name: str) -> str:
        return os.path.join(self.disk_dir, name + SUFFIX)

    def _write(self, name: str, arrays) -> None:
        """Write a block through to disk; a failed write (disk full, folder gone) is logged
        and skipped: the block is simply not on disk (its lookup finds no whole file)."""
        try:
            try:
                write_block(self._path(name), arrays)
            except FileNotFoundError:  # the folder was removed: make it again, once
                os.makedirs(self.disk_dir, exist_ok=True)
                write_block(self._path(name), arrays)
        except OSError as e:
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 1000 == 0:
                logger.warning("KV disk tier: could not write a block (%s); %d failed so far",
                               e.strerror or e, self.write_errors)

    def _read(self, name: str):
        """A block's arrays from its file; any failure (damaged, gone, unreadable) is a
        CorruptBlockError, so the engine undoes the step and computes the block instead."""
        try:
            return read_block(self._path(name), [h[0] for h in self.host])
        except CorruptBlockError:
            raise
        except OSError as e:
            raise CorruptBlockError(f"KV block file {name} could not be read "
                                    f"({e.strerror or e})") from None

    def apply(self, t, kv_cache):
        """Make the copies of KVTransfers `t`; returns the pool (the same one, updated in
        place). Raises jaxkv.core.disk_tier.CorruptBlockError for a block file that is damaged
        (deleted) or cannot be read: the step fails before it ran and is undone, and its
        blocks are computed again. A failed write is logged and skipped."""
        if t.device_to_host:
            bids, slots = (list(x) for x in zip(*t.device_to_host))
            ids = np.zeros(pow2_at_least(len(bids), 1), np.int32)
            ids[:len(bids)] = bids
            for h, d in zip(self.host, jax.device_get(self._gather(kv_cache, ids))):
                h[slots] = d[:len(slots)]
        for slot, name in t.host_to_disk:
            self._write(name, [h[slot] for h in self.host])
        loads = [(bid, [h[slot] for h in self.host]) for slot, bid in t.host_to_device]
        loads += [(bid, self._read(name)) for name, bid in t.disk_to_device]
        if not loads:
            return kv_cache
        n = pow2_at_least(len(loads), 1)
        ids = np.zeros(n, np.int32)
        ids[:len(loads)] = [bid for bid, _ in loads]
        data = []
        for i, h in enumerate(self.host):
            buf = np.zeros((n, *h.shape[1:]), h.dtype)
            for j, (_, arrays) in enumerate(loads):
                buf[j] = arrays[i]
            data.append(buf)
        return self._scatter(kv_cache, ids, data)
