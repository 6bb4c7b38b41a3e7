"""The C++ ragged paged attention (jaxkv/cpu_kernels/attention.py, the "cpu" backend)
against plain causal attention (test_xla_ragged's cases: decodes, prefill chunks, mixed steps,
padding) and against the oracle on pools written by kv_pool.write_kv in every pool dtype
(float32, bfloat16 and float8 held as bits, float16, int8 with scales), q in float32,
bfloat16 and float16, head sizes on and off the vector paths, contexts split over both
threads; bad metadata is an error, not a wild read. (The build: test_build.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import get_attention
from jaxkv.attention.kv_pool import new_kv_pool, write_kv
from jaxkv.cpu_kernels import attention as cpu_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.attention.test_xla_ragged import CASES, make_case

ATTEND = jax.jit(cpu_attention.ragged_paged_attention,
                 static_argnames=("scale", "layer", "kv_dtype"))
ORACLE = jax.jit(ragged_paged_attention_reference, static_argnames=("scale", "layer", "kv_dtype"))


def test_kernel_builds_here():
    assert cpu_attention.load() is not None, cpu_attention.build_error()


@pytest.mark.parametrize("ctx,qlen", CASES)
@pytest.mark.parametrize("block_size,group,head_dim", [(16, 3, 64), (8, 1, 32), (32, 8, 16),
                                                        (16, 4, 128), (16, 2, 40)])
def test_matches_dense_attention(ctx, qlen, block_size, group, head_dim):
    rng = np.random.default_rng(sum(ctx) + block_size)
    args, ref, n = make_case(rng, ctx, qlen, block_size=block_size, num_kv_heads=2, group=group,
                             head_dim=head_dim, num_tokens=sum(qlen) + 3, max_seqs=6, layers=2)
    out = np.asarray(ATTEND(*args, scale=head_dim ** -0.5, layer=1))
    assert np.max(np.abs(out[:n] - ref)) / np.max(np.abs(ref)) < 1e-5
    assert np.all(out[n:] == 0) and np.isfinite(out).all()


LAYERS, BLOCKS, BS, KVH, D = 2, 96, 16, 3, 64


def written_pool(dtype, seed=0):
    """A pool of `dtype` with every block but the null one written through write_kv (layer 1)."""
    rng = np.random.default_rng(seed)
    pool = new_kv_pool((LAYERS, BLOCKS, BS, KVH, D), jnp.dtype(dtype))
    slots = jnp.asarray(np.arange(BS, BLOCKS * BS), jnp.int32)
    k, v = (jnp.asarray(rng.standard_normal((slots.shape[0], KVH, D)), jnp.float32)
            for _ in range(2))
    return write_kv(pool, k, v, slots, 1)


def step(rng, ctx, qlen, group, q_dtype=np.float32, pad_rows=2, pad_seqs=1):
    """Step metadata over random non-contiguous tables, and q (padding rows zero)."""
    nb = max(-(-c // BS) for c in ctx)
    tables = np.zeros((len(ctx) + pad_seqs, nb + 1), np.int32)
    for s, c in enumerate(ctx):
        tables[s, :-(-c // BS)] = rng.permutation(np.arange(1, BLOCKS))[:-(-c // BS)]
    seq_lens = np.array(list(ctx) + [0] * pad_seqs, np.int32)
    qsl = np.concatenate([[0], np.cumsum(list(qlen) + [0] * pad_seqs)]).astype(np.int32)
    t = int(qsl[-1])
    q = np.zeros((t + pad_rows, KVH * group, D), np.float32)
    q[:t] = rng.standard_normal((t, KVH * group, D))
    return (jnp.asarray(q, q_dtype), jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(qsl),
            jnp.array([len(ctx)], jnp.int32)), t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn",
                                   "float8_e5m2"])
def test_every_pool_dtype_matches_the_oracle(dtype):
    """Decodes, a prefill chunk over a cached prefix and a long prompt tail in one step, on a
    pool as the engine writes it (bits, scales)."""
    pool = written_pool(dtype)
    rng = np.random.default_rng(1)
    args, t = step(rng, [1, 77, 300, 40, 16], [1, 1, 45, 40, 3], group=3)
    kw = dict(scale=D ** -0.5, layer=1, k_scale=pool.k_scale, v_scale=pool.v_scale,
              kv_dtype=pool.dtype)
    out = np.asarray(ATTEND(args[0], pool.k, pool.v, *args[1:], **kw))
    ref = np.asarray(ORACLE(args[0], pool.k, pool.v, *args[1:], **kw))
    assert np.max(np.abs(out - ref)) < 1e-5 * np.max(np.abs(ref))
    assert np.all(out[t:] == 0)


@pytest.mark.parametrize("q_dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
def test_half_precision_queries_give_their_own_dtype(q_dtype, tol):
    pool = written_pool("bfloat16", seed=2)
    rng = np.random.default_rng(3)
    args, t = step(rng, [33, 130], [1, 20], group=2, q_dtype=q_dtype)
    kw = dict(scale=0.125, layer=1, kv_dtype=pool.dtype)
    out = ATTEND(args[0], pool.k, pool.v, *args[1:], **kw)
    ref = ORACLE(args[0].astype(jnp.float32), pool.k, pool.v, *args[1:], **kw)
    assert out.dtype == q_dtype
    assert np.max(np.abs(np.asarray(out, np.float32) - np.asarray(ref))) < tol


@pytest.mark.parametrize("ctx,qlen", [([1400], [1]), ([1400], [600]), ([9] * 40, [1] * 40)])
def test_long_contexts_and_many_rows(ctx, qlen):
    """One long decode (split by KV head over the threads), a long chunk (rows path, many
    items), many short decodes."""
    pool = written_pool("float32", seed=4)
    rng = np.random.default_rng(5)
    args, _ = step(rng, ctx, qlen, group=3, pad_rows=0)
    out = np.asarray(ATTEND(args[0], pool.k, pool.v, *args[1:], scale=0.125, layer=1))
    ref = np.asarray(ORACLE(args[0], pool.k, pool.v, *args[1:], scale=0.125, layer=1))
    assert np.max(np.abs(out - ref)) < 1e-5 * np.max(np.abs(ref))


def test_sequences_without_query_rows():
    """A sequence inside num_seqs that has no query rows this step (and one of length 0) is
    skipped, as the oracle does."""
    pool = written_pool("float32", seed=7)
    args, t = step(np.random.default_rng(8), [30, 50, 16, 1], [1, 0, 3, 0], group=3)
    q, tables, seq_lens, qsl, n = args
    seq_lens = seq_lens.at[3].set(0)
    out = np.asarray(ATTEND(q, pool.k, pool.v, tables, seq_lens, qsl, n, scale=0.125, layer=1))
    ref = np.asarray(ORACLE(q, pool.k, pool.v, tables, seq_lens, qsl, n, scale=0.125, layer=1))
    assert np.max(np.abs(out - ref)) < 1e-5 * np.max(np.abs(ref)) and np.all(out[t:] == 0)


@pytest.mark.parametrize("what", ["block id", "short table", "qsl decreasing", "qsl past rows",
                                  "qsl start", "num_seqs", "v pool", "pool type", "scales"])
def test_bad_arguments_are_an_error(what):
    """What the engine never sends, the kernel refuses rather than reading out of bounds."""
    pool = written_pool("int8" if what == "scales" else "float32")
    args, _ = step(np.random.default_rng(6), [40, 20], [1, 20], group=1)
    q, tables, seq_lens, qsl, n = args
    k, v, kw = pool.k, pool.v, dict(k_scale=pool.k_scale, v_scale=pool.v_scale,
                                    kv_dtype=pool.dtype)
    if what == "block id":
        tables = tables.at[0, 1].set(BLOCKS)
    elif what == "short table":
        seq_lens = seq_lens.at[0].set(BS * tables.shape[1] + 1)
    elif what == "qsl decreasing":
        qsl = qsl.at[2].set(qsl[1] + seq_lens[1] + 1)
    elif what == "qsl past rows":
        qsl = qsl.at[2:].set(q.shape[0] + 1)
    elif what == "qsl start":
        qsl = qsl.at[0].set(1)
    elif what == "num_seqs":
        n = jnp.array([tables.shape[0] + 1], jnp.int32)
    elif what == "v pool":
        v = v[:, :BLOCKS // 2]
    elif what == "pool type":  # bfloat16 bits read as if they were float32 values
        k, v = (jax.lax.bitcast_convert_type(x, jnp.uint16)[..., 0] for x in (k, v))
    else:
        kw.update(k_scale=pool.k_scale[:, :BLOCKS // 2])
    with pytest.raises(Exception, match="cpu attention"):
        jax.block_until_ready(ATTEND(q, k, v, tables, seq_lens, qsl, n, scale=1.0, layer=1,
                                     **kw))


def test_backend_is_registered_and_bad_names_refused():
    assert get_attention("cpu").name == "cpu"
    with pytest.raises(ValueError, match="'cpu', 'xla' or 'pallas'"):
        get_attention("cuda")
    with pytest.raises(ValueError, match="unsupported KV cache dtype int16"):
        cpu_attention.ragged_paged_attention(
            jnp.zeros((1, 1, 8)), jnp.zeros((2, 4, 1, 8), jnp.int16),
            jnp.zeros((2, 4, 1, 8), jnp.int16), jnp.zeros((1, 1), jnp.int32),
            jnp.ones((1,), jnp.int32), jnp.array([0, 1], jnp.int32), jnp.ones((1,), jnp.int32),
            scale=1.0)


@pytest.mark.parametrize("group", [3, 8, 16])
def test_a_decode_alone_equals_the_same_decode_in_a_batch(group):
    """Fewer sequences than threads split a decode's KV heads over the threads; the result is
    bitwise the same as in a batch (the same path and arithmetic per head), whatever the
    group size (8 or more query heads per KV head reach the rows path's threshold)."""
    pool = written_pool("float32", seed=11)
    (q2, tb2, sl2, qsl2, n2), _ = step(np.random.default_rng(0), [300, 200], [1, 1], group=group,
                                       pad_rows=0, pad_seqs=0)
    alone = ATTEND(q2[:1], pool.k, pool.v, tb2[:1], sl2[:1], jnp.asarray([0, 1], jnp.int32),
                   jnp.asarray([1], jnp.int32), scale=0.125, layer=1)
    batch = ATTEND(q2, pool.k, pool.v, tb2, sl2, qsl2, n2, scale=0.125, layer=1)
    assert np.array_equal(np.asarray(alone)[0], np.asarray(batch)[0])
