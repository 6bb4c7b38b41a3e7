"""The C++ decode kernel (jaxkv/attention/cpu_decode.py) against the xla path's own per-row
loop, on pools written by kv_pool.write_kv in every pool dtype (float32, bfloat16 and float8
held as bits, float16, int8 with scales), with rows of context 0, few rows (the kernel splits
them by KV head) and many, long contexts, and non-contiguous block tables; and the "cpu"
backend against plain causal attention through test_xla_ragged's cases."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import cpu_decode, get_attention
from jaxkv.attention.kv_pool import new_kv_pool, write_kv
from jaxkv.attention.xla_ragged import _row_attention, xla_ragged_paged_attention
from tests.attention.test_xla_ragged import CASES, make_case

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason="no C++ compiler")

LAYERS, BLOCKS, BS, KVH, D = 2, 96, 16, 3, 64


def pool_and_rows(dtype, rows, ctx, group, seed=0):
    """A pool of `dtype` filled through write_kv (layer 1) and decode rows over it."""
    rng = np.random.default_rng(seed)
    pool = new_kv_pool((LAYERS, BLOCKS, BS, KVH, D), jnp.dtype(dtype))
    slots = (np.arange(1, BLOCKS) * BS)[:, None] + np.arange(BS)  # every block but the null one
    slots = jnp.asarray(slots.reshape(-1), jnp.int32)
    k = jnp.asarray(rng.standard_normal((slots.shape[0], KVH, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((slots.shape[0], KVH, D)), jnp.float32)
    pool = write_kv(pool, k, v, slots, 1)
    nb = max(1, -(-max(ctx) // BS))
    tables = np.stack([rng.permutation(np.arange(1, BLOCKS))[:nb] for _ in range(rows)])
    tables = jnp.asarray(np.pad(tables, ((0, 0), (0, 8))), jnp.int32)  # a chunk's overrun
    q = jnp.asarray(rng.standard_normal((rows, KVH, group, D)) * D ** -0.5, jnp.float32)
    return pool, q, tables, jnp.asarray(ctx, jnp.int32)


def both(pool, q, tables, ctx):
    parts = (pool.k, pool.v, pool.k_scale, pool.v_scale, pool.dtype)
    mine = jax.jit(lambda q, t, c: cpu_decode.row_kernel(q, parts, 1, t, c))(q, tables, ctx)
    ref = jax.jit(lambda q, t, c: _row_attention(q, parts, 1, t, c, 8, BS))(q, tables, ctx)
    return [np.asarray(x) for x in mine], [np.asarray(x) for x in ref]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn",
                                   "float8_e5m2"])
@pytest.mark.parametrize("rows,group", [(2, 3), (13, 1), (40, 4)])
def test_matches_row_loop(dtype, rows, group):
    rng = np.random.default_rng(rows)
    ctx = rng.integers(1, 300, rows)
    ctx[0], ctx[-1] = 0, 1  # a skipped row and a one-key row
    (m, l, acc), (rm, rl, racc) = both(*pool_and_rows(dtype, rows, ctx, group))
    assert np.array_equal(np.isfinite(m), np.isfinite(rm)) and not np.isfinite(m[0]).any()
    assert np.all(l[0] == 0) and np.all(acc[0] == 0)
    live = ctx > 0
    np.testing.assert_allclose(m[live], rm[live], rtol=1e-5, atol=1e-5)
    out = acc[live] / l[live][..., None]
    ref = racc[live] / rl[live][..., None]
    assert np.max(np.abs(out - ref)) < 1e-5 * max(1.0, np.max(np.abs(ref)))
    np.testing.assert_allclose(l[live], rl[live], rtol=1e-4)


def test_long_context_one_row():
    """One row of 1,400 keys (split by KV head over the threads)."""
    (m, l, acc), (rm, rl, racc) = both(*pool_and_rows("float32", 1, [1400], 3, seed=5))
    np.testing.assert_allclose(acc / l[..., None], racc / rl[..., None], atol=1e-5)


@pytest.mark.parametrize("ctx,qlen", CASES)
def test_cpu_backend_matches_dense_attention(ctx, qlen):
    """The whole ragged attention with the kernel as its row path, as test_xla_ragged checks
    the xla path: decode rows, prefill chunks and mixed steps against plain attention."""
    rng = np.random.default_rng(sum(ctx))
    args, ref, n = make_case(rng, ctx, qlen, block_size=16, num_kv_heads=2, group=3,
                             head_dim=64, num_tokens=sum(qlen) + 3, max_seqs=6, layers=2)
    f = functools.partial(xla_ragged_paged_attention, chunk_tokens=32, segment_rows=8,
                          row_kernel=cpu_decode.row_kernel)
    out = np.asarray(jax.jit(lambda *a: f(*a, scale=0.125, layer=1))(*args))
    assert np.max(np.abs(out[:n] - ref)) / np.max(np.abs(ref)) < 1e-5
    assert np.all(out[n:] == 0) and np.isfinite(out).all()


def test_backend_is_registered_and_bad_names_refused():
    assert get_attention("cpu").name == "cpu"
    with pytest.raises(ValueError, match="'cpu', 'xla' or 'pallas'"):
        get_attention("cuda")
    with pytest.raises(ValueError, match="unsupported KV cache dtype int16"):
        cpu_decode.paged_decode(jnp.zeros((1, 1, 1, 8)), jnp.zeros((1, 2, 4, 1, 8), jnp.int16),
                                jnp.zeros((1, 2, 4, 1, 8), jnp.int16),
                                jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), layer=0)


def test_build_is_cached_and_failure_is_reported(tmp_path, monkeypatch):
    """A second build with the same key reuses the library; a compiler that fails gives its
    message, and no half-written library is left behind."""
    cxx = cpu_decode._compiler()
    monkeypatch.setenv("JAXKV_KERNEL_CACHE", str(tmp_path))
    first = cpu_decode._build(cxx)
    stamp = first.stat().st_mtime_ns
    assert cpu_decode._build(cxx) == first and first.stat().st_mtime_ns == stamp
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_decode, "SOURCE", bad)
    with pytest.raises(RuntimeError, match="failed"):
        cpu_decode._build(cxx)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, "bad.cc"])
