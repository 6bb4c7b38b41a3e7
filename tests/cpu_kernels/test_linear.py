"""The C++ matmuls of a decode step's rows (jaxkv/cpu_kernels/linear.py) against float64 numpy
products. The streaming kernel: every row count it takes (1-16), sizes on and off its 16-lane vectors, 4-row steps, 64-row chunks
and 1024-column groups (2500 columns: three groups, the last with a scalar tail), several weights
in one call, the transposed (embedding) layout; a row's result does not depend on the other
rows. The GEMM kernel (17-128 rows): row counts on and off its 8-row passes, widths on and off
its 48-column strips and 16-lane vectors, K on and off its 192-row blocks, several weights in
one call; a row's result does not depend on the other rows, nor a weight's on the weights
beside it. Bad shapes and types are refused with the argument named. The model with the kernel
(LlamaModel.cpu_matmul) is checked against transformers in tests/models/test_architectures.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cpu_kernels import linear as cpu_linear

MATMUL = jax.jit(cpu_linear.matmul, static_argnames=("transposed",))


def check_against_float64(rows, k, ns):
    """x [rows, k] @ each of the [k, n] weights, random, against float64 products."""
    rng = np.random.default_rng(rows * 1000 + k)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    ws = [rng.standard_normal((k, n)).astype(np.float32) for n in ns]
    ys = MATMUL(jnp.asarray(x), *map(jnp.asarray, ws))
    assert len(ys) == len(ws)
    for w, y in zip(ws, ys):
        ref = x.astype(np.float64) @ w.astype(np.float64)
        assert y.shape == ref.shape and y.dtype == jnp.float32
        if ref.size:  # a [K, 0] weight next to others: an empty result
            assert np.max(np.abs(np.asarray(y) - ref)) <= 2e-6 * np.sqrt(k) * np.max(np.abs(ref))


def test_kernel_builds_here():
    from jaxkv import cpu_kernels
    assert cpu_kernels.load() is not None, cpu_kernels.build_error()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("k,ns", [(576, (576, 192, 192)), (64, (1536,)), (37, (5, 70, 129)),
                                  (1536, (576,)), (16, (16, 17)),
                                  (130, (2500, 3)), (64, (0, 5)), (300, (40, 33))])
def test_matches_float64_product(rows, k, ns):
    check_against_float64(rows, k, ns)


@pytest.mark.parametrize("rows", [17, 23, 24, 32, 33, 47, 64, 100, 128])
@pytest.mark.parametrize("k,ns", [(576, (576, 192, 192)), (1536, (576,)), (37, (5, 70, 129)),
                                  (193, (2500, 48)), (1, (49, 16)), (64, (0, 5)), (0, (48, 7))])
def test_gemm_matches_float64_product(rows, k, ns):
    check_against_float64(rows, k, ns)


def test_gemm_rows_and_weights_are_independent():
    # 400 = two whole 192-row blocks and a short one; 610 columns: 12 strips and a 34-column
    # one (two vectors and a 2-column tail); alone, the weight's columns are shared among the
    # cores differently than beside a second weight.
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((128, 400)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((400, 610)), jnp.float32)
    other = jnp.asarray(rng.standard_normal((400, 1000)), jnp.float32)
    (full,) = MATMUL(x, w)
    for r, n in ((0, 17), (5, 20), (40, 24), (17, 47), (60, 64), (3, 125)):
        (alone,) = MATMUL(x[r:r + n], w)
        assert np.array_equal(np.asarray(alone), np.asarray(full)[r:r + n])
    beside, _ = MATMUL(x, w, other)
    _, first = MATMUL(x, other, w)
    assert np.array_equal(np.asarray(beside), np.asarray(full))
    assert np.array_equal(np.asarray(first), np.asarray(full))
    assert np.array_equal(np.asarray(MATMUL(x, w)[0]), np.asarray(full))  # run to run
    # NaN and inf stay in their rows and columns
    bad = x.at[3, 7].set(jnp.nan).at[9, 0].set(jnp.inf)
    (y,) = MATMUL(bad, w)
    y, full = np.asarray(y), np.asarray(full)
    assert np.isnan(y[3]).all() and not np.isfinite(y[9]).any()
    keep = np.ones(len(y), bool)
    keep[[3, 9]] = False
    assert np.array_equal(y[keep], full[keep])


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(1000, 576), (33, 40), (7, 16)])
def test_transposed_matches_float64_product(rows, n, k):
    rng = np.random.default_rng(rows + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    table = rng.standard_normal((n, k)).astype(np.float32)
    (y,) = MATMUL(jnp.asarray(x), jnp.asarray(table), transposed=True)
    ref = x.astype(np.float64) @ table.astype(np.float64).T
    assert y.shape == (rows, n)
    assert np.max(np.abs(np.asarray(y) - ref)) <= 2e-6 * np.sqrt(k) * np.max(np.abs(ref))


@pytest.mark.parametrize("transposed", [False, True])
def test_a_row_does_not_depend_on_the_other_rows(transposed):
    # K = 300: four whole 64-row chunks and a short one, so one and two rows read several
    # chunks side by side (linear.cc's chunks_rows) where 8 rows read them one at a time;
    # 300 table rows: a 256-row block read in quarters side by side, and a 44-row one.
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((300, 300) if transposed else (300, 260)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 300)), jnp.float32)
    (full,) = MATMUL(x, w, transposed=transposed)
    for r, n in ((0, 1), (3, 1), (7, 1), (2, 2), (5, 3)):
        (alone,) = MATMUL(x[r:r + n], w, transposed=transposed)
        assert np.array_equal(np.asarray(alone), np.asarray(full)[r:r + n])


def test_bad_input_is_refused():
    x, w = jnp.zeros((2, 8)), jnp.zeros((8, 4))
    with pytest.raises(ValueError, match="1 to 8 weights"):
        cpu_linear.matmul(x)
    with pytest.raises(ValueError, match=r"x must be float32 \[T <= 128, K\], got float32\[129, 8\]"):
        cpu_linear.matmul(jnp.zeros((129, 8)), w)
    with pytest.raises(ValueError, match=r"x must be float32 \[T <= 16, K\], got float32\[17, 8\]"):
        cpu_linear.matmul(jnp.zeros((17, 8)), jnp.zeros((4, 8)), transposed=True)
    with pytest.raises(ValueError, match=r"x must be float32"):
        cpu_linear.matmul(x.astype(jnp.bfloat16), w)
    with pytest.raises(ValueError, match=r"a weight must be float32 \[8, N\], got float32\[9, 4\]"):
        cpu_linear.matmul(x, jnp.zeros((9, 4)))
    with pytest.raises(ValueError, match=r"a weight must be float32 \[N, 8\]"):
        cpu_linear.matmul(x, w, transposed=True)
    with pytest.raises(ValueError, match="a weight must be float32"):
        cpu_linear.matmul(x, w.astype(jnp.bfloat16))
    assert cpu_linear.applies(x, w) and cpu_linear.applies(jnp.zeros((16, 8)), w)
    assert cpu_linear.applies(jnp.zeros((17, 8)), w) and cpu_linear.applies(jnp.zeros((128, 8)), w)
    assert not cpu_linear.applies(jnp.zeros((129, 8)), w)
    table = jnp.zeros((4, 8))
    assert cpu_linear.applies(jnp.zeros((4, 8)), table, transposed=True)
    assert not cpu_linear.applies(jnp.zeros((5, 8)), table, transposed=True)
    assert not cpu_linear.applies(x, jnp.zeros((9, 4)))  # K differs
    assert not cpu_linear.applies(x, w.astype(jnp.bfloat16))
    # an untied LM head of a large vocabulary at 16 rows: its partial sums would not fit
    x16, head = jnp.zeros((16, 2048)), jnp.zeros((2048, 32768))
    assert not cpu_linear.applies(x16, head) and cpu_linear.applies(x16[:4], head)
    assert cpu_linear.applies(jnp.zeros((17, 2048)), head)  # the GEMM keeps no partial sums
    with pytest.raises(ValueError, match=r"would take 64.0 MiB of scratch \(limit 32 MiB\)"):
        cpu_linear.matmul(x16, head)
