"""Both kernels pass Pallas's Triton lowering, on this CPU machine: jit(...).trace(...).lower(
lowering_platforms=("cuda",)) runs the Pallas -> Triton IR lowering (the step that rejects
non-power-of-two arrays, unsupported primitives, mixed-dtype or batched dots and TPU-only APIs)
without a GPU. What it cannot check is Triton's own compilation to PTX, which happens in XLA's
GPU compiler on the device (the gpu-marked tests and benchmarks/gpu_check.sh do that)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import paged_attention, ragged_paged_attention

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_h200(f, *args):
    """StableHLO text of f lowered for CUDA. jax >= 0.11 asks which GPU to target when none is
    attached: an abstract mesh with an H200 abstract device names it (jax 0.10 needs none)."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", None, "cuda"))
    with jax.sharding.use_abstract_mesh(mesh):
        return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def shapes(dtype, group, head_dim, block_size, tokens=24, seqs=5, layers=2):
    kvh = 2
    sd = jax.ShapeDtypeStruct
    pool = sd((layers, 64, block_size, kvh, head_dim), dtype)
    return dict(q=sd((tokens, kvh * group, head_dim), dtype), k=pool, v=pool,
                bt=sd((seqs, 9), jnp.int32), sl=sd((seqs,), jnp.int32),
                qsl=sd((seqs + 1,), jnp.int32), ns=sd((1,), jnp.int32), layer=sd((), jnp.int32))


CASES = [(jnp.float32, 3, 64, 16), (jnp.bfloat16, 8, 128, 8), (jnp.bfloat16, 1, 64, 32),
         (jnp.float16, 4, 128, 16)]


@pytest.mark.parametrize("dtype,group,head_dim,block_size", CASES)
def test_ragged_kernel_lowers_to_triton(dtype, group, head_dim, block_size):
    s = shapes(dtype, group, head_dim, block_size)
    f = jax.jit(lambda q, k, v, bt, sl, qsl, ns, layer: ragged_paged_attention(
        q, k, v, bt, sl, qsl, ns, scale=head_dim ** -0.5, layer=layer))
    text = lower_for_h200(f, *s.values())
    assert text.count(TRITON_CALL) == 1


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype,group,head_dim,block_size", CASES)
def test_decode_kernel_lowers_to_triton(dtype, group, head_dim, block_size, splits):
    s = shapes(dtype, group, head_dim, block_size, tokens=5)
    f = jax.jit(lambda q, k, v, bt, sl, layer: paged_attention(
        q, k, v, bt, sl, scale=head_dim ** -0.5, layer=layer, num_splits=splits))
    text = lower_for_h200(f, s["q"], s["k"], s["v"], s["bt"], s["sl"], s["layer"])
    assert text.count(TRITON_CALL) == 1


def test_lowering_check_can_fail():
    """The check is not vacuous: a kernel with a non-power-of-two array fails the same lowering."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    f = jax.jit(lambda x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((12,), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(x))
    with pytest.raises(Exception, match="power of 2"):
        lower_for_h200(f, jax.ShapeDtypeStruct((12,), jnp.float32))


# Quantized and bit-stored pools as jaxkv keeps them (jaxkv/attention/kv_pool.py): the pool's
# array type, the values' type (kv_dtype), and whether per-token scales (bfloat16 bits) come.
POOLS = [(jnp.int8, None, True), (jnp.uint16, "bfloat16", False),
         (jnp.uint8, "float8_e4m3fn", True), (jnp.uint8, "float8_e5m2", True)]


@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("pool_dtype,kv_dtype,scaled", POOLS)
def test_kernels_lower_with_quantized_and_bit_pools(pool_dtype, kv_dtype, scaled, q_dtype):
    s = shapes(pool_dtype, 3, 64, 16)
    sd = jax.ShapeDtypeStruct
    scale = sd(s["k"].shape[:-1], jnp.uint16) if scaled else None
    q = sd(s["q"].shape, q_dtype)
    kw = dict(scale=0.125, kv_dtype=kv_dtype)
    ragged = jax.jit(lambda q, k, v, ks, vs, bt, sl, qsl, ns, layer: ragged_paged_attention(
        q, k, v, bt, sl, qsl, ns, layer=layer, k_scale=ks, v_scale=vs, **kw))
    text = lower_for_h200(ragged, q, s["k"], s["v"], scale, scale, s["bt"], s["sl"], s["qsl"],
                          s["ns"], s["layer"])
    assert text.count(TRITON_CALL) == 1
    qd = sd((5,) + q.shape[1:], q_dtype)
    decode = jax.jit(lambda q, k, v, ks, vs, bt, sl, layer: paged_attention(
        q, k, v, bt, sl, layer=layer, k_scale=ks, v_scale=vs, num_splits=2, **kw))
    text = lower_for_h200(decode, qd, s["k"], s["v"], scale, scale, s["bt"], s["sl"], s["layer"])
    assert text.count(TRITON_CALL) == 1
