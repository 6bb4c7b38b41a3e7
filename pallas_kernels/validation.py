"""Input validation shared by the Pallas kernels: ValueError naming the argument.

Besides shapes and dtypes it enforces, before anything is traced, the rules of Pallas's Triton
lowering, because interpret mode (the only mode that runs on a CPU) accepts programs that the
Triton lowering rejects:
  * every array a kernel loads, computes or stores has a power-of-two number of elements
    (the tuning knobs block_m / block_k, the padded query group, head_dim);
  * every operand of a dot has each dimension >= 16 (tensor-core tile minimum);
  * operands of a dot share one element type (each loaded K/V block is cast to q's dtype; the
    pool itself may be narrower: bfloat16, float16, int8 or float8, the last two with scales).
The kernels themselves use no TPU-only API (no pltpu, no PrefetchScalarGridSpec), read block
tables and the layer index by ref indexing, and accumulate in float32.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# KV pool dtypes (a narrower pool holds more tokens; blocks are cast to q's dtype when loaded).
# The one-byte ones are quantized: int8 needs per-token, per-KV-head scales (k_scale, v_scale);
# float8 takes them too, or is read unscaled.
SCALED_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
KV_DTYPES = FLOAT_DTYPES + SCALED_DTYPES
# A pool may hold bfloat16 / float8 values (and bfloat16 scales) as their bits, in unsigned
# integers of the same width (XLA:CPU scatters into those in place; see jaxkv/attention/
# kv_pool.py); `kv_dtype` then names the values' type, and a uint16 scale array holds bfloat16.
BIT_DTYPES = (jnp.uint8, jnp.uint16)


def view_as(x, dtype):
    """x seen as `dtype` (None: x as it is): x itself when it has that type, else a bitcast of
    its bits (same width). Works on arrays and on values loaded inside a kernel."""
    if dtype is None or x.dtype == jnp.dtype(dtype):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))


def scale_values(s):
    """Loaded scales as a float type: uint16 bits are bfloat16's."""
    return view_as(s, jnp.bfloat16) if s.dtype == jnp.uint16 else s


MIN_DOT_DIM = 16


def is_pow2(n) -> bool:
    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1 and not n & (n - 1)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def padded_group(group: int) -> int:
    """Rows a KV head's query group is padded to for the decode kernel's dots: a power of two,
    at least 16 (3 for SmolLM2 -> 16, 8 -> 16, 32 -> 32)."""
    return max(MIN_DOT_DIM, next_pow2(group))


def check_knob(name: str, value, *, minimum: int = MIN_DOT_DIM) -> None:
    """A tuning knob that sizes a kernel array: a power of two >= minimum."""
    if not is_pow2(value) or value < minimum:
        raise ValueError(f"{name} must be a power of two >= {minimum} (a Triton block shape), "
                         f"got {value!r}")


def check_positive(name: str, value) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_launch(num_warps, num_stages) -> None:
    if not is_pow2(num_warps) or num_warps > 32:
        raise ValueError(f"num_warps must be a power of two <= 32, got {num_warps!r}")
    check_positive("num_stages", num_stages)


def check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not scale > 0:
        raise ValueError(f"scale must be a positive Python number (static), got {scale!r}")
    return float(scale)


def check_int_array(name: str, x, ndim: int) -> None:
    if getattr(x, "ndim", None) != ndim or jnp.dtype(x.dtype) != jnp.int32:
        raise ValueError(f"{name} must be an int32 array with {ndim} dimension(s), got "
                         f"{getattr(x, 'dtype', type(x).__name__)} of shape {getattr(x, 'shape', None)}")


def check_pool(q, k_cache, v_cache, layer, kv_dtype=None) -> tuple[int, int, int, int]:
    """q [rows, num_q_heads, head_dim] against the pool ([num_blocks, block_size, num_kv_heads,
    head_dim], or [num_layers, ...] with `layer`; of a KV_DTYPES type, or holding kv_dtype's
    bits). Returns (num_kv_heads, group, head_dim, block_size)."""
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q must be [tokens, num_q_heads, head_dim], got shape {getattr(q, 'shape', None)}")
    if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if getattr(k_cache, "ndim", None) not in (4, 5):
        raise ValueError("k_cache must be [num_blocks, block_size, num_kv_heads, head_dim] or "
                         f"[num_layers, num_blocks, ...], got shape {getattr(k_cache, 'shape', None)}")
    if getattr(v_cache, "shape", None) != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {k_cache.shape}, got "
                         f"{getattr(v_cache, 'shape', None)}")
    kv_names = [jnp.dtype(d).name for d in KV_DTYPES]
    if kv_dtype is not None and (
            jnp.dtype(kv_dtype).name not in kv_names
            or jnp.dtype(k_cache.dtype) not in [jnp.dtype(d) for d in (kv_dtype, *BIT_DTYPES)]
            or jnp.dtype(k_cache.dtype).itemsize != jnp.dtype(kv_dtype).itemsize):
        raise ValueError(f"kv_dtype {kv_dtype!r} must be one of {kv_names} and the pool "
                         f"({k_cache.dtype}) of that type or its bits (same width)")
    values = jnp.dtype(kv_dtype if kv_dtype is not None else k_cache.dtype)
    if k_cache.dtype != v_cache.dtype or values.name not in kv_names:
        raise ValueError(f"k_cache and v_cache must share one dtype of {kv_names} (the kernels "
                         f"cast each loaded block to q's dtype), got {k_cache.dtype} and "
                         f"{v_cache.dtype}")
    if k_cache.ndim == 5:
        if layer is None:
            raise ValueError("layer is required with a stacked [num_layers, ...] k_cache")
        if isinstance(layer, numbers.Integral) and not 0 <= layer < k_cache.shape[0]:
            raise ValueError(f"layer must be in [0, {k_cache.shape[0]}), got {layer}")
        if not isinstance(layer, numbers.Integral) and (
                getattr(layer, "size", 0) != 1 or not jnp.issubdtype(layer.dtype, jnp.integer)):
            raise ValueError(f"layer must be a Python int or an int32 scalar, got {layer!r}")
    elif layer is not None:
        raise ValueError("layer must be None with a single-layer (4-D) k_cache")
    *_, block_size, num_kv_heads, head_dim = k_cache.shape
    _, num_q_heads, q_head_dim = q.shape
    if q_head_dim != head_dim:
        raise ValueError(f"q's head_dim {q_head_dim} must equal k_cache's {head_dim}")
    if not is_pow2(head_dim) or head_dim < MIN_DOT_DIM:
        raise ValueError(f"head_dim must be a power of two >= {MIN_DOT_DIM} (a dot operand "
                         f"dimension), got {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q's num_q_heads {num_q_heads} must be a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    return num_kv_heads, num_q_heads // num_kv_heads, head_dim, block_size


def check_scales(k_cache, k_scale, v_scale, kv_dtype=None):
    """The scales of a quantized pool: (k_scale, v_scale), each float (or uint16 bits of
    bfloat16) [*k_cache.shape[:-1]] (one per token slot and KV head), or None for an unscaled
    pool. Both or neither; an int8 pool requires them, a 16/32-bit pool refuses them."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together")
    dtype = jnp.dtype(kv_dtype if kv_dtype is not None else k_cache.dtype)
    if k_scale is None:
        if dtype == jnp.int8:
            raise ValueError("an int8 pool needs k_scale and v_scale")
        return None
    if dtype not in [jnp.dtype(d) for d in SCALED_DTYPES]:
        raise ValueError(f"k_scale and v_scale go with an int8 or float8 pool, not {dtype.name}")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if getattr(x, "shape", None) != k_cache.shape[:-1] or jnp.dtype(x.dtype) not in [
                jnp.dtype(d) for d in FLOAT_DTYPES + (jnp.uint16,)]:
            raise ValueError(f"{name} must be float (or uint16 bits of bfloat16) "
                             f"{k_cache.shape[:-1]} (the pool's shape without head_dim), got "
                             f"{getattr(x, 'dtype', None)} of shape {getattr(x, 'shape', None)}")
    return k_scale, v_scale


def as_stacked(k_cache, v_cache, layer, scales, kv_dtype):
    """What a kernel is launched with: a 4-D pool (and its scales) given a layer axis of 1 with
    layer 0, and kv_dtype as a name (a static jit argument) or None."""
    if k_cache.ndim == 4:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
        scales = scales and tuple(x[None] for x in scales)
    return k_cache, v_cache, layer, scales, None if kv_dtype is None else jnp.dtype(kv_dtype).name


def check_tables(block_tables, seq_lens) -> int:
    """block_tables int32 [rows, max_blocks], seq_lens int32 [rows]. Returns rows."""
    check_int_array("block_tables", block_tables, 2)
    check_int_array("seq_lens", seq_lens, 1)
    if seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"seq_lens must have block_tables' {block_tables.shape[0]} rows, got "
                         f"{seq_lens.shape[0]}")
    return block_tables.shape[0]



def check_window(window):
    """A sliding window: a positive int, or None for none. ValueError naming it otherwise."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    return window


def check_softcap(softcap):
    """Attention logit soft-capping: a positive number (a Python float), or None."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    return float(softcap)
