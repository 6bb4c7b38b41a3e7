"""Sliding-window attention and logit soft-capping (Gemma 2) on every path: the oracle against
plain attention per sequence (float64 numpy), and the XLA path, both Pallas kernels
(interpret mode) and the cpu backend's layers against the oracle, on random ragged batches
(mixed prefill chunks and decodes, non-contiguous block tables, padding rows) with windows
shorter than, equal to and longer than the contexts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention.xla_ragged import xla_ragged_paged_attention
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference as oracle
from tests.attention.test_xla_ragged import make_case

CASES = [([40], [40]), ([33, 70], [33, 20]), ([5, 130, 17, 64], [1, 40, 17, 3]),
         ([40, 7, 90, 33], [20, 1, 5, 1])]
DECODES = [([15, 16, 17, 90], [1, 1, 1, 1]), ([1, 64, 33], [1, 1, 1])]
WINDOWS = [1, 5, 16, 37, 1000]


def dense_window(q, k, v, window, scale, softcap=None):
    """One sequence: q [T, H, D] of positions 0..T-1, k/v [T, KVH, D]; row p sees keys
    p - window + 1 .. p; scores soft-capped with `softcap`."""
    t, h, _ = q.shape
    g = h // k.shape[1]
    k, v = (np.repeat(x, g, axis=1).astype(np.float64) for x in (k, v))
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * scale
    if softcap is not None:
        s = np.tanh(s / softcap) * softcap
    p_, k_ = np.arange(t)[:, None], np.arange(t)[None, :]
    s = np.where(((k_ <= p_) & (k_ > p_ - window))[None], s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", w / w.sum(axis=-1, keepdims=True), v)


def case(ctx, qlen, seed=0, block_size=16, group=2, head_dim=32):
    rng = np.random.default_rng(seed + sum(ctx))
    args, _, n = make_case(rng, ctx, qlen, block_size=block_size, num_kv_heads=2, group=group,
                           head_dim=head_dim, num_tokens=sum(qlen) + 3, max_seqs=6, layers=2)
    return args, n


@pytest.mark.parametrize("window,softcap", [(w, None) for w in WINDOWS] + [(5, 0.5), (1000, 0.5)])
def test_the_oracle_is_windowed_attention(window, softcap):
    (q, k, v, tables, lens, qsl, ns), n = case([33, 70], [33, 20])
    out = np.asarray(oracle(q, k, v, tables, lens, qsl, ns, scale=0.2, layer=1, window=window,
                            softcap=softcap))
    t = 0
    for s, (c, m) in enumerate(zip([33, 70], [33, 20])):
        pos = np.arange(c)
        kk = np.asarray(k)[1, np.asarray(tables)[s, pos // 16], pos % 16]
        vv = np.asarray(v)[1, np.asarray(tables)[s, pos // 16], pos % 16]
        qq = np.zeros((c, *q.shape[1:]), np.float32)
        qq[c - m:] = np.asarray(q)[t:t + m]
        ref = dense_window(qq, kk, vv, window, 0.2, softcap)[c - m:]
        assert np.abs(out[t:t + m] - ref).max() < 1e-5
        t += m


PATHS = {
    "xla": functools.partial(xla_ragged_paged_attention, chunk_tokens=32, segment_rows=8),
    "pallas_ragged": functools.partial(ragged_paged_attention, interpret=True),
}


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("ctx,qlen", CASES + DECODES)
@pytest.mark.parametrize("path", list(PATHS))
def test_every_path_matches_the_oracle(path, ctx, qlen, window):
    args, n = case(ctx, qlen)
    ref = np.asarray(oracle(*args, scale=0.2, layer=1, window=window))
    out = np.asarray(jax.jit(lambda *a: PATHS[path](*a, scale=0.2, layer=1, window=window))(*args))
    assert np.abs(out[:n] - ref[:n]).max() / np.abs(ref[:n]).max() < 1e-5
    assert np.all(out[n:] == 0)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("ctx,qlen", DECODES)
@pytest.mark.parametrize("splits", [1, 3])
def test_the_decode_kernel_matches_the_oracle(ctx, qlen, window, splits):
    (q, k, v, tables, lens, qsl, ns), n = case(ctx, qlen)
    ref = np.asarray(oracle(q, k, v, tables, lens, qsl, ns, scale=0.2, layer=1, window=window))
    rows = len(ctx)
    out = paged_attention(q[:rows], k, v, tables[:rows], lens[:rows], scale=0.2, layer=1,
                          window=window, num_splits=splits, interpret=True)
    assert np.abs(np.asarray(out) - ref[:rows]).max() / np.abs(ref[:rows]).max() < 1e-5


def test_the_engine_backends_pass_the_window():
    """Each backend's attend (the cpu backend's windowed layers take the XLA path) equals the
    oracle; a bad window fails in one line."""
    from jaxkv.attention import KVPool, get_attention
    from jaxkv.step_input import StepInput
    (q, k, v, tables, lens, qsl, ns), n = case([40, 7, 90, 33], [20, 1, 5, 1])
    ref = np.asarray(oracle(q, k, v, tables, lens, qsl, ns, scale=0.2, layer=1, window=9))
    pool = KVPool(k, v, None, None, "float32")
    z = jnp.zeros(q.shape[0], jnp.int32)
    step = StepInput(z, z, z, tables, lens, qsl, ns, z[:1], jnp.zeros((q.shape[0], 16)),
                     jnp.zeros((q.shape[0], 16)), z[:1])
    for name in ("xla", "cpu", "pallas"):
        att = get_attention(name)
        out = att.attend(q, pool, step, att.prepare(step, 16), layer=1, scale=0.2, window=9)
        assert np.abs(np.asarray(out)[:n] - ref[:n]).max() < 1e-5, name
    with pytest.raises(ValueError, match="window must be a positive int or None, got 0"):
        ragged_paged_attention(q, k, v, tables, lens, qsl, ns, scale=0.2, layer=1, window=0,
                               interpret=True)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("ctx,qlen", [CASES[2], DECODES[0]])
@pytest.mark.parametrize("path", list(PATHS) + ["pallas_decode"])
def test_softcap_on_every_path(path, ctx, qlen, window):
    args, n = case(ctx, qlen)
    kw = dict(scale=0.2, layer=1, window=window, softcap=0.5)
    ref = np.asarray(oracle(*args, **kw))
    if path == "pallas_decode":
        if any(x != 1 for x in qlen):
            pytest.skip("decode-only batches")
        q, k, v, tables, lens, *_ = args
        rows = len(ctx)
        out = np.asarray(paged_attention(q[:rows], k, v, tables[:rows], lens[:rows], interpret=True,
                                         **kw))
        n = rows
    else:
        out = np.asarray(jax.jit(lambda *a: PATHS[path](*a, **kw))(*args))
    assert np.abs(out[:n] - ref[:n]).max() / np.abs(ref[:n]).max() < 1e-5
