"""The KV pool goes through the jitted step by donation: updated in place, never copied."""

import jax
import numpy as np

from benchmarks.hlo_values import copies, large_values

from jaxkv.core.scheduler_output import SchedulerOutput
from jaxkv.runner.buckets import num_rows
from jaxkv.runner.input_builder import build_step_input


def _compiled(r, t, kv):
    si = build_step_input(SchedulerOutput([]), block_size=r.block_size, num_tokens=t,
                          rows=num_rows(t, r.max_num_seqs), max_blocks=r.max_blocks,
                          rope_table=r.rope_table)
    return r.jitted_step.lower(r.params, kv, si).compile()


def _memory(r, t, kv):
    return _compiled(r, t, kv).memory_analysis()


def test_step_updates_the_pool_in_place(llm):
    r = llm.llm_engine.runner
    layer_bytes = r.kv_cache.k.nbytes // r.kv_cache.k.shape[0]
    bigger = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0], 3 * x.shape[1]) + x.shape[2:],
                                                         x.dtype), r.kv_cache)
    pool_bytes = sum(x.nbytes for x in jax.tree.leaves(r.kv_cache))
    for t in (r.token_buckets[0], r.token_buckets[-1]):
        exe = _compiled(r, t, r.kv_cache)
        mem = exe.memory_analysis()
        # What gpu_engine's memory rows read on a GPU: the optimized HLO holds values of the
        # pool's size (its parameters, the in-place writes), but no copy of a tenth of it.
        values = large_values(exe.as_text(), pool_bytes // 10)
        assert {"parameter", "fusion"} <= {v["opcode"] for v in values} and not copies(values)
        # The outputs alias the donated pool (K and V), and the step's scratch does not grow
        # with the pool: nothing pool-sized is copied.
        assert mem.alias_size_in_bytes >= 2 * r.kv_cache.k.nbytes
        assert _memory(r, t, bigger).temp_size_in_bytes == mem.temp_size_in_bytes
    # For the decode bucket all temporaries together are smaller than one layer's K cache.
    assert _memory(r, r.token_buckets[0], r.kv_cache).temp_size_in_bytes < layer_bytes
    si = r.build_inputs(SchedulerOutput([]), r.token_buckets[0])  # (the runner's inputs)
    ptrs = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(r.kv_cache)]
    old = r.kv_cache
    r.forward(si)
    jax.block_until_ready(r.kv_cache)
    assert all(x.is_deleted() for x in jax.tree.leaves(old))
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(r.kv_cache)] == ptrs
    assert np.isfinite(np.asarray(r.kv_cache.k[:, :2])).all()
