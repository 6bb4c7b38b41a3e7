"""The plan's KV arithmetic (engine_config: DTYPE_BYTES, KV_SCALE_BYTES -> core.kv_budget) counts
exactly the bytes that the pool's arrays hold, for every pool dtype: the two layers keep their
own constants (the config layer imports no JAX), and this test holds them together."""

import jax.numpy as jnp
import pytest

from jaxkv.attention.kv_pool import QUANTIZED_DTYPES, SCALE_DTYPE, is_quantized, new_kv_pool
from jaxkv.core.kv_budget import bytes_per_token
from jaxkv.engine_config import DTYPE_BYTES, KV_SCALE_BYTES

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 2, 3, 4, 2, 8


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_plan_counts_the_pool_arrays(dtype):
    pool = new_kv_pool((LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype)
    arrays = [a for a in (pool.k, pool.v, pool.k_scale, pool.v_scale) if a is not None]
    held = sum(a.nbytes for a in arrays) // (BLOCKS * BLOCK_SIZE)
    planned = bytes_per_token(LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES[dtype], KV_SCALE_BYTES.get(dtype, 0))
    assert held == planned
    assert is_quantized(dtype) == (dtype in KV_SCALE_BYTES) == (pool.k_scale is not None)


def test_scale_bytes_are_the_scale_dtype():
    assert set(KV_SCALE_BYTES.values()) == {jnp.dtype(SCALE_DTYPE).itemsize}
    assert set(KV_SCALE_BYTES) == set(QUANTIZED_DTYPES)


@pytest.mark.parametrize("dtype", ["uint8", "bool", "float8_e4m3fnuz", "float16"])
def test_other_narrow_dtypes_are_not_quantized(dtype):
    assert not is_quantized(dtype)
