"""jaxkv's XLA attention path (jaxkv/attention/xla_ragged.py) and the oracle
(pallas_kernels/reference.py), each against plain causal attention per sequence, with random
non-contiguous block tables, mixed prefill chunks / decodes, and padding rows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention.xla_ragged import xla_ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference

# The XLA path with small tiles (so the cases cross chunk and segment edges), and the oracle.
IMPLS = {"xla": functools.partial(xla_ragged_paged_attention, chunk_tokens=32, segment_rows=8),
         "oracle": ragged_paged_attention_reference}


def dense_causal_attention(q, k, v, *, scale: float):
    """Plain causal attention for one sequence, in float64 numpy: q [T, H, D], k/v [T, KVH, D]."""
    t, h, d = q.shape
    g = h // k.shape[1]
    k = np.repeat(k, g, axis=1).astype(np.float64)
    v = np.repeat(v, g, axis=1).astype(np.float64)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * scale
    s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(axis=-1, keepdims=True), v).astype(np.float32)


def make_case(rng, ctx_lens, q_lens, *, block_size, num_kv_heads, group, head_dim, num_tokens,
              max_seqs, num_blocks=64, layers=1, dtype=np.float32):
    heads = num_kv_heads * group
    max_blocks = max(-(-c // block_size) for c in ctx_lens) + 1
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((max_seqs, max_blocks), np.int32)
    k_cache = rng.standard_normal((layers, num_blocks, block_size, num_kv_heads, head_dim)).astype(dtype)
    v_cache = rng.standard_normal(k_cache.shape).astype(dtype)
    q = np.full((num_tokens, heads, head_dim), np.nan, dtype)  # NaN until filled; padding zeroed below
    seq_lens = np.zeros(max_seqs, np.int32)
    qsl = np.zeros(max_seqs + 1, np.int32)
    refs, used, t = [], 0, 0
    for s, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        nb = -(-c // block_size)
        tables[s, :nb] = perm[used:used + nb]
        used += nb
        q[t:t + n] = rng.standard_normal((n, heads, head_dim))
        seq_lens[s] = c
        qsl[s + 1] = t + n
        # Dense reference: the whole context in order, causal, keeping the last n query rows.
        pos = np.arange(c)
        kk = k_cache[-1, tables[s, pos // block_size], pos % block_size]
        vv = v_cache[-1, tables[s, pos // block_size], pos % block_size]
        qq = np.zeros((c, heads, head_dim), dtype)
        qq[c - n:] = q[t:t + n]
        refs.append(dense_causal_attention(qq, kk, vv, scale=head_dim ** -0.5)[c - n:])
        t += n
    qsl[len(ctx_lens) + 1:] = t
    q[t:] = 0.0
    args = (jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(tables),
            jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.array([len(ctx_lens)], jnp.int32))
    return args, np.concatenate(refs), t


CASES = [  # (context lengths, query lengths): decode-only, prefill-only, mixed, edges
    ([1], [1]), ([15, 16, 17], [1, 1, 1]), ([40], [40]), ([33, 70], [33, 20]),
    ([5, 300, 17, 64], [1, 128, 17, 3]), ([129, 1, 16], [1, 1, 16]),
    ([2, 100, 61, 9], [1, 4, 29, 2]),  # 2- and 4-token chunks; a last segment past the end
    ([40, 7, 90, 33], [20, 1, 5, 1]),  # decodes after chunks (packed per-row rows)
]


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("ctx,qlen", CASES)
@pytest.mark.parametrize("block_size,group,head_dim", [(16, 3, 64), (8, 1, 32), (32, 8, 16)])
def test_matches_dense_attention(impl, ctx, qlen, block_size, group, head_dim):
    rng = np.random.default_rng(sum(ctx) + block_size)
    num_tokens = sum(qlen) + 3
    args, ref, n = make_case(rng, ctx, qlen, block_size=block_size, num_kv_heads=2, group=group,
                             head_dim=head_dim, num_tokens=num_tokens, max_seqs=6, layers=2)
    f = jax.jit(lambda *a: IMPLS[impl](*a, scale=head_dim ** -0.5, layer=1))
    out = np.asarray(f(*args))
    err = np.max(np.abs(out[:n] - ref)) / np.max(np.abs(ref))
    assert err < 1e-5, err
    assert np.all(out[n:] == 0) and np.isfinite(out).all()


@pytest.mark.parametrize("impl", list(IMPLS))
def test_unstacked_pool_and_bf16(impl):
    rng = np.random.default_rng(0)
    args, ref, n = make_case(rng, [50, 9], [10, 1], block_size=16, num_kv_heads=2, group=4,
                             head_dim=64, num_tokens=16, max_seqs=4)
    q, k, v, *rest = args
    out = np.asarray(IMPLS[impl](q, k[0], v[0], *rest, scale=0.125))
    assert np.max(np.abs(out[:n] - ref)) / np.max(np.abs(ref)) < 1e-5
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    outb = IMPLS[impl](qb, kb[0], vb[0], *rest, scale=0.125)
    assert outb.dtype == jnp.bfloat16
    assert np.max(np.abs(np.asarray(outb[:n], np.float32) - ref)) / np.max(np.abs(ref)) < 2e-2
