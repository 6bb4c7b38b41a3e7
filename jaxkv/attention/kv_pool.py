"""The KV pool: every layer's K and V in fixed-size blocks, plus scales when it is quantized.

One preallocated pytree, donated to the jitted step and updated in place:
  k, v: [num_layers, num_blocks, block_size, num_kv_heads, head_dim] in the pool's dtype
    (kv_cache_dtype: the weights' dtype, or bfloat16 / float16, or a one-byte type);
  k_scale, v_scale: for a one-byte pool (int8, float8_e4m3fn, float8_e5m2), bfloat16
    [num_layers, num_blocks, block_size, num_kv_heads] (held as uint16 bits): one scale per
    token slot and KV head, so that key = k x k_scale; None for a 16/32-bit pool.

Quantization is symmetric, per token and per KV head (the granularity of LMDeploy's online
int8 KV cache; KIVI, Liu et al. 2024, studies why per-token suits values): scale =
max|x| / qmax, stored in bfloat16, and the stored values are computed with the stored scale,
so rounding the scale costs nothing. A token's scale is fixed when it is written, so blocks
filled one token at a time never rescale what they already hold. The scales cost 2 bytes per
token and KV head next to head_dim bytes of values (3% at head_dim 64).

An int8 pool also stores K and V rotated by an orthonormal Hadamard matrix H over head_dim
(QuaRot, Ashkboos et al. 2024): a fixed rotation spreads each row's energy over its channels,
so the row maximum that sets the int8 step sits closer to the typical value. Attention is
unchanged by it: the query is rotated too (q H . k H = q . k) and the output rotated back
(sum p v H = o H). Measured on SmolLM2 (docs/kv-cache-dtype.md): mean |first-token logprob
difference| against a float32 pool 0.054 without the rotation, 0.026 with it. float8 keeps a
relative precision per value, which a rotation does not improve, so it is stored unrotated.

Storage: bfloat16 and float8 values (and the bfloat16 scales) are held as their bits, in
uint16 / uint8 arrays, and viewed as their type where they are read (a bitcast of what was
loaded; inside the Pallas kernels too, as vLLM keeps an fp8 cache in uint8 tensors). XLA:CPU
lowers a scatter into a bfloat16 or float8 array by converting the whole array to float32
and back: about 700 ms per layer write into a 1 GiB bfloat16 pool, against 0.05 ms with
the values held as 16-bit integers. `KVPool.dtype` names the values' type.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from pallas_kernels.validation import view_as

# One scale per token and KV head; the plan counts its 2 bytes (jaxkv/engine_config.py's
# KV_SCALE_BYTES, held to this pool's arrays by tests/attention/test_kv_pool_bytes.py).
SCALE_DTYPE = jnp.bfloat16
# The pool dtypes quantized per token and KV head (the plan's KV_SCALE_BYTES names the same).
QUANTIZED_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
# Value types held as their bits (see the module docstring: XLA:CPU's scatter).
_BITS = {"bfloat16": jnp.uint16, "float8_e4m3fn": jnp.uint8, "float8_e5m2": jnp.uint8}


def storage_dtype(dtype):
    """The array type that holds values of `dtype` in the pool: their bits for bfloat16 and
    float8, the type itself otherwise."""
    return jnp.dtype(_BITS.get(jnp.dtype(dtype).name, dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    """The pool's arrays as stored (see the module docstring), a pytree whose static `dtype`
    names the type of the values in k and v."""
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))


def split_by_kv_head(pool: KVPool, axis: str):
    """PartitionSpecs splitting a KVPool on its KV-head axis (`axis` of a device mesh): values
    [L, blocks, block_size, kv_heads, head_dim] and scales [L, blocks, block_size, kv_heads]."""
    from jax.sharding import PartitionSpec as P
    return jax.tree.map(lambda x: P(*([None] * 3 + [axis] + [None] * (x.ndim - 4))), pool)


def is_quantized(dtype) -> bool:
    """Whether a pool of this dtype stores scales (int8 and the two float8 formats)."""
    return jnp.dtype(dtype).name in QUANTIZED_DTYPES


def new_kv_pool(shape: tuple[int, int, int, int, int], dtype) -> KVPool:
    """A zeroed pool of shape [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    holding values of `dtype`."""
    name = jnp.dtype(dtype).name
    k, v = (jnp.zeros(shape, storage_dtype(dtype)) for _ in range(2))
    if not is_quantized(dtype):
        return KVPool(k, v, dtype=name)
    ks, vs = (jnp.zeros(shape[:-1], storage_dtype(SCALE_DTYPE)) for _ in range(2))
    return KVPool(k, v, ks, vs, dtype=name)


def quantize(x, dtype):
    """x float [..., head_dim] -> (values in `dtype` [..., head_dim], bfloat16 scale [...]),
    with x ~= values x scale. int8: rounded to nearest in [-127, 127]; float8: the format's own
    rounding, saturated at its largest finite value (float8_e4m3fn has no infinity). A row of
    zeros gets scale 0 and zero values."""
    dtype = jnp.dtype(dtype)
    qmax = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
    xf = x.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(xf), axis=-1) / qmax).astype(SCALE_DTYPE)
    s = scale.astype(jnp.float32)
    y = jnp.clip(xf / jnp.where(s > 0, s, 1.0)[..., None], -qmax, qmax)
    return (jnp.round(y) if dtype == jnp.int8 else y).astype(dtype), scale


def dequantize(values, scale):
    """values x scale as float32 (scale broadcast over head_dim); values when scale is None."""
    if scale is None:
        return values.astype(jnp.float32)
    return values.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> np.ndarray:
    """The orthonormal n x n rotation of an int8 pool, float32: Sylvester's Hadamard matrix
    over blocks of the largest power of two dividing n (block-diagonal when n is not a power
    of two, e.g. 5 blocks of 16 for n = 80), scaled to be orthonormal and symmetric. Built once
    per n (read-only)."""
    b = n & -n  # the largest power of two dividing n
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    out = np.kron(np.eye(n // b, dtype=np.float32), h / np.sqrt(b, dtype=np.float32))
    out.flags.writeable = False
    return out


def is_rotated(pool: KVPool) -> bool:
    """Whether the pool stores K and V rotated by hadamard(head_dim) (an int8 pool)."""
    return pool.dtype == "int8"


def rotate(x):
    """x [..., head_dim] times hadamard(head_dim), in float32 and back to x's dtype (the
    rotation is its own inverse)."""
    h = jnp.asarray(hadamard(x.shape[-1]))
    return jnp.matmul(x.astype(jnp.float32), h).astype(x.dtype)


def write_kv(pool: KVPool, k, v, slot_mapping, layer) -> KVPool:
    """Write this step's K/V into the pool at their slots.

    k, v: [num_tokens, num_kv_heads, head_dim] float; slot_mapping: int32 [num_tokens],
    slot = block_id * block_size + offset (padding rows point into the null block 0); layer:
    int32 scalar. K/V are cast to the pool's dtype, or quantized with their scales for a
    one-byte pool, then stored (as bits where the pool holds bits). Returns the updated pool:
    an in-place scatter when the pool is donated.
    """
    block_size = pool.k.shape[2]
    blk, off = slot_mapping // block_size, slot_mapping % block_size

    def put(cache, x):
        return cache.at[layer, blk, off].set(view_as(x, cache.dtype))

    if pool.k_scale is None:
        return dataclasses.replace(pool, k=put(pool.k, k.astype(pool.dtype)),
                                   v=put(pool.v, v.astype(pool.dtype)))
    (kq, ks), (vq, vs) = quantize(k, pool.dtype), quantize(v, pool.dtype)
    return dataclasses.replace(pool, k=put(pool.k, kq), v=put(pool.v, vq),
                               k_scale=put(pool.k_scale, ks), v_scale=put(pool.v_scale, vs))
