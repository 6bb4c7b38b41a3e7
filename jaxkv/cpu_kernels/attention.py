"""The CPU attention kernel: ragged paged attention as an XLA FFI custom call in C++
(attention.cc) that reads K/V blocks in place from the pool; the "cpu" attention backend
(jaxkv.attention).

On XLA:CPU any jnp formulation copies a step's K/V blocks out of the pool before it computes
(XLA materializes the gather, since each key serves a whole query group), then runs small
batched GEMMs: 7-9 ms per layer for 64 decoding sequences x 256 keys of SmolLM2 where reading
their K/V costs ~1-2 ms, and 16 ms per layer for six 16-token prompt tails over 1,536 cached
keys. The kernel tiles as FlashAttention-2 does for variable-length batches (Dao 2023): a work
item is one KV head of up to 32 / group query rows of one sequence, its keys go by tiles of
16 (transposed into a buffer, so the score GEMM has keys in the SIMD lanes), with an online
softmax; every K/V row is read once per item for all its rows and query heads, and items are
spread over XLA's intra-op thread pool. Semantics are pallas_kernels.reference's (vLLM's
ragged paged attention), against which it is tested. Pool element types: float32, bfloat16,
float16, and the one-byte types (int8, float8_e4m3fn, float8_e5m2) with their scales; q and
the output in float32, bfloat16 or float16.

Build and loading: jaxkv/cpu_kernels/build.py (`load()` and `build_error()` are imported
here); an engine asked for "auto" uses the xla backend when the kernel cannot be built
(jaxkv/engine/setup.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cpu_kernels.build import build_error, load

TARGET = "jaxkv_ragged_paged_attention"


@functools.cache
def _lut(name: str) -> np.ndarray:
    """float32 [256]: the value of each byte of a one-byte pool type."""
    import ml_dtypes
    dtype = np.int8 if name == "int8" else getattr(ml_dtypes, name)
    return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def _kind(stored, kv_dtype: str | None) -> tuple[int, str | None]:
    """The kernel's element kind of a pool array (and the one-byte type's name)."""
    name = jnp.dtype(kv_dtype or stored).name
    if name == "float32":
        return 0, None
    if name == "bfloat16":
        return 1, None
    if name == "float16":
        return 2, None
    if name in ("int8", "float8_e4m3fn", "float8_e5m2"):
        return 3, name
    raise ValueError(f"cpu attention: unsupported KV cache dtype {name}")


def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           num_seqs, *, scale: float, layer: int | None = None, k_scale=None,
                           v_scale=None, kv_dtype: str | None = None):
    """Ragged paged attention on the CPU, reading the pool in place.

    Arguments, shapes and result as pallas_kernels.reference.ragged_paged_attention_reference:
    q float32 / bfloat16 / float16 [num_tokens, num_q_heads, head_dim] (head_dim <= 256,
    at most 32 query heads per KV head); k_cache, v_cache as stored (jaxkv.attention.kv_pool:
    float32 / float16, bfloat16 / float8 bits, int8), stacked [L, num_blocks, block_size,
    num_kv_heads, head_dim] with a static `layer`, or one layer's 4-D pool with layer None;
    kv_dtype names the values' type when the pool holds their bits; k_scale, v_scale: bfloat16
    scales (or their uint16 bits) [.., num_blocks, block_size, num_kv_heads] of a one-byte
    pool, else None; int32 block_tables [S, N], seq_lens [S], query_start_loc [S + 1]
    (starting at 0), num_seqs [1]. Returns [num_tokens, num_q_heads, head_dim] in q's dtype
    (float32 for a q of any other type), zeros past the last real sequence.

    Raises RuntimeError if the kernel is not built (load() is None), ValueError for an
    unsupported pool type; inconsistent arguments (a block id outside the pool, a context
    longer than its table, query_start_loc past num_tokens or decreasing, pools or scales of
    the wrong shape) fail the call with an XLA error naming "cpu attention", never a read
    out of bounds.
    """
    if load() is None:
        raise RuntimeError(f"cpu attention kernel unavailable: {build_error()}")
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
        k_scale, v_scale = (None, None) if k_scale is None else (k_scale[None], v_scale[None])
    kind, name = _kind(k_cache.dtype, kv_dtype)
    if kind == 3:
        lut = jnp.asarray(_lut(name))
        ks, vs = (jax.lax.bitcast_convert_type(s, jnp.uint16) if s.dtype != jnp.uint16 else s
                  for s in (k_scale, v_scale))
    else:
        lut = jnp.zeros((1,), jnp.float32)
        ks = vs = jnp.zeros((1,), jnp.uint16)
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        q = q.astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(q, k_cache, v_cache, ks, vs, lut, i32(block_tables), i32(seq_lens),
                i32(query_start_loc), i32(num_seqs), layer=np.int64(layer),
                kind=np.int64(kind), scale=np.float32(scale))
