"""Attention for the model: the backend chosen once per engine (the pool and its slot-mapping
K/V write are in kv_pool.py).

`get_attention(backend)` returns an `Attention` record built at engine build and held by the
model (no backend string travels through the layers):
  - "xla": jaxkv/attention/xla_ragged.py, ragged paged attention in pure jnp tuned for XLA;
    its per-step row metadata is computed once (`prepare`) and shared by every layer.
  - "cpu": jaxkv/cpu_kernels/attention.py, ragged paged attention in C++ (an XLA FFI custom
    call built on first use with the machine's compiler) that reads the pool's blocks in
    place: decode rows, prefill chunks and prompt tails alike. The default on a CPU; per
    device under tensor parallelism (`per_shard`), like a Pallas call. On one device the
    engine pairs it with the C++ matmul of few-row steps (jaxkv/cpu_kernels/linear.py).
  - "pallas": the Pallas kernels of pallas_kernels/: the ragged kernel for steps with prefill
    chunks, the decode kernel for decode-only steps (StepInput.decode_only, static, so each
    token bucket has a decode program of its own). Native on a GPU; interpret mode elsewhere
    (correct but slow: for tests, never for serving on a CPU).
All three compute exactly pallas_kernels.reference.ragged_paged_attention_reference (the oracle
they are tested against).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from pallas_kernels.paged_attention import paged_attention as decode_kernel
from pallas_kernels.ragged_paged_attention import DEFAULT_BLOCK_M
from pallas_kernels.ragged_paged_attention import ragged_paged_attention as ragged_kernel
from pallas_kernels.validation import next_pow2

from jaxkv import cpu_kernels
from jaxkv.attention.kv_pool import (KVPool, is_rotated, new_kv_pool, rotate,  # noqa: F401
                                    split_by_kv_head, write_kv)
from jaxkv.attention.xla_ragged import ragged_metadata, xla_ragged_paged_attention
from jaxkv.cpu_kernels import attention as cpu_attention
from jaxkv.step_input import StepInput


def pallas_interpret() -> bool:
    """Whether the Pallas kernels must run in interpret mode: everywhere but on a GPU."""
    return jax.default_backend() != "gpu"


def pallas_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *,
                     scale: float, layer=None, k_scale=None, v_scale=None, kv_dtype=None,
                     decode_only: bool = False, window: int | None = None,
                     softcap: float | None = None):
    """The Pallas kernels behind the oracle's signature (q float32/bfloat16 [num_tokens,
    num_q_heads, head_dim] -> the same shape and dtype; pools stacked with `layer`, or one
    layer's, with their scales when quantized and their values' type when they hold its bits;
    int32 tables as in pallas_kernels.reference). The ragged kernel, or, when the
    caller promises (static `decode_only`) that every real sequence has exactly one query row,
    so that row s is sequence s, the decode kernel. Rows past the last real sequence are zeros
    either way. window, softcap: sliding-window attention and logit soft-capping (the
    oracle's). Raises ValueError
    (pallas_kernels.validation) for shapes the kernels refuse."""
    interpret = pallas_interpret()
    if not decode_only:
        group = q.shape[1] // k_cache.shape[-2]  # a tile holds at least one token's group
        return ragged_kernel(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                             num_seqs, scale=scale, layer=layer, k_scale=k_scale,
                             v_scale=v_scale, kv_dtype=kv_dtype, interpret=interpret,
                             block_m=max(DEFAULT_BLOCK_M, next_pow2(group)), window=window,
                             softcap=softcap)
    rows = min(q.shape[0], block_tables.shape[0])
    lens = jnp.where(jnp.arange(rows) < num_seqs[0], seq_lens[:rows], 0)  # padding rows -> 0
    out = decode_kernel(q[:rows], k_cache, v_cache, block_tables[:rows], lens, scale=scale,
                        layer=layer, k_scale=k_scale, v_scale=v_scale, kv_dtype=kv_dtype,
                        interpret=interpret, window=window, softcap=softcap)
    return jnp.pad(out, ((0, q.shape[0] - rows), (0, 0), (0, 0)))


@dataclasses.dataclass(frozen=True)
class Attention:
    """An attention backend. `prepare(step, block_size)` runs once per step (inside the jitted
    step) and returns what every layer shares; `attend(q, pool, step, shared, *, layer,
    scale, window=None, softcap=None)` -> [num_tokens, num_q_heads, head_dim] for a KVPool
    and a layer index (window: the layer's sliding window, a static int; softcap: its logit
    soft-capping, a static float; None: off).
    `uses_decode_only`: whether the runner should mark decode-only steps (each such step shape
    is then a program of its own)."""
    name: str
    prepare: Callable[[StepInput, int], Any]
    attend: Callable[..., jax.Array]
    uses_decode_only: bool


def _xla_prepare(step: StepInput, block_size: int):
    return ragged_metadata(step.num_tokens, block_size, step.block_tables, step.seq_lens,
                           step.query_start_loc, step.num_seqs)


def _xla_attend(q, pool: KVPool, step: StepInput, shared, *, layer, scale, window=None,
                softcap=None):
    return xla_ragged_paged_attention(q, pool.k, pool.v, step.block_tables, step.seq_lens,
                                      step.query_start_loc, step.num_seqs, scale=scale,
                                      layer=layer, k_scale=pool.k_scale, v_scale=pool.v_scale,
                                      kv_dtype=pool.dtype, metadata=shared, window=window,
                                      softcap=softcap)


def _cpu_attend(q, pool: KVPool, step: StepInput, shared, *, layer, scale, window=None,
                softcap=None):
    if window is not None or softcap is not None:  # not in the C++ kernel yet: the XLA path
        return _xla_attend(q, pool, step, None, layer=layer, scale=scale, window=window,
                           softcap=softcap)
    return cpu_attention.ragged_paged_attention(
        q, pool.k, pool.v, step.block_tables, step.seq_lens, step.query_start_loc,
        step.num_seqs, scale=scale, layer=layer, k_scale=pool.k_scale, v_scale=pool.v_scale,
        kv_dtype=pool.dtype)


def _pallas_attend(q, pool: KVPool, step: StepInput, shared, *, layer, scale, window=None,
                   softcap=None):
    return pallas_attention(q, pool.k, pool.v, step.block_tables, step.seq_lens,
                            step.query_start_loc, step.num_seqs, scale=scale, layer=layer,
                            k_scale=pool.k_scale, v_scale=pool.v_scale, kv_dtype=pool.dtype,
                            decode_only=step.decode_only, window=window, softcap=softcap)


_BACKENDS = {
    "xla": Attention("xla", _xla_prepare, _xla_attend, uses_decode_only=False),
    "cpu": Attention("cpu", lambda step, block_size: None, _cpu_attend, uses_decode_only=False),
    "pallas": Attention("pallas", lambda step, block_size: None, _pallas_attend,
                        uses_decode_only=True),
}


def write_and_attend(attention: Attention, q, k, v, pool: KVPool, step: StepInput, shared, *,
                     layer, scale: float, window: int | None = None,
                     softcap: float | None = None):
    """One layer's paged attention: write this step's K/V ([T, num_kv_heads, head_dim]) into
    the pool at the slot mapping, then attend q [T, num_q_heads, head_dim] over it. For a pool
    stored rotated (int8, kv_pool.is_rotated) q, k and v are rotated first and the output is
    rotated back, which leaves the result unchanged but for quantization. window: the layer's
    sliding window (None: global); softcap: its logit soft-capping (None: off). Returns (output [T, num_q_heads, head_dim] in q's dtype,
    the updated pool)."""
    rotated = is_rotated(pool)
    if rotated:
        q, k, v = rotate(q), rotate(k), rotate(v)
    pool = write_kv(pool, k, v, step.slot_mapping, layer)
    extra = {k: v for k, v in (("window", window), ("softcap", softcap)) if v is not None}
    out = attention.attend(q, pool, step, shared, layer=layer, scale=scale, **extra)
    return (rotate(out) if rotated else out), pool


def per_shard(attention: Attention, mesh, axis: str = "tp") -> Attention:
    """Tensor parallelism for a kernel XLA cannot partition (a Pallas call): `attend` runs per
    device under jax.shard_map, on the device's query heads [T, Hq / n, D] and its KV heads of
    the pool (split on its KV-head axis), with the step's metadata replicated. The pool must be
    split by KV head (jaxkv/models/sharding.py)."""
    from jax.sharding import PartitionSpec as P
    heads = P(None, axis, None)

    def attend(q, pool, step, shared, *, layer, scale, **extra):
        pool_spec = split_by_kv_head(pool, axis)
        body = lambda q, pool, step, shared: attention.attend(  # noqa: E731
            q, pool, step, shared, layer=layer, scale=scale, **extra)
        return jax.shard_map(body, mesh=mesh, in_specs=(heads, pool_spec, P(), P()),
                             out_specs=heads, check_vma=False)(q, pool, step, shared)
    return dataclasses.replace(attention, attend=attend)


def get_attention(backend: str, mesh=None) -> Attention:
    """The Attention of a resolved backend name ("cpu" | "xla" | "pallas"); ValueError
    otherwise, and for "cpu" when its kernel cannot be built (the compiler's message). With a
    tensor-parallel `mesh` the Pallas kernels and the C++ kernel run per shard (`per_shard`);
    the XLA path is partitioned by XLA from the shardings of its operands."""
    if backend not in _BACKENDS:
        raise ValueError(f"attention backend must be 'cpu', 'xla' or 'pallas', got {backend!r}")
    if backend == "cpu" and (why := cpu_kernels.unavailable()):
        raise ValueError(why)
    if mesh is not None and backend in ("pallas", "cpu"):
        return per_shard(_BACKENDS[backend], mesh)
    return _BACKENDS[backend]
