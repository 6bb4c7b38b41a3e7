"""The kernels compiled natively (interpret=False) on a GPU, against the float32 reference.
Marked `gpu`; skipped where JAX sees no GPU device (the only skip in the suite)."""

import zlib

import jax
import numpy as np
import pytest

from pallas_kernels import paged_attention, ragged_paged_attention
from tests.pallas.cases import TOLERANCE, full_product, make_inputs, pairwise, rel_error


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no GPU device")]

RAGGED = pairwise(full_product())
DECODE = pairwise(full_product(kinds=("decode",)))


@pytest.fixture(autouse=True)
def ieee_float32():
    """The XLA reference must not use TF32 on the GPU (the kernel's float32 dots are IEEE)."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("index,case", list(enumerate(RAGGED)), ids=[c.id for c in RAGGED])
def test_ragged_native(index, case):
    inputs = make_inputs(case, zlib.crc32(case.id.encode()), stacked=index % 2 == 0)
    out = ragged_paged_attention(*inputs.args, scale=case.head_dim ** -0.5, layer=inputs.layer)
    out = np.asarray(out, np.float32)
    assert rel_error(out, inputs) < TOLERANCE[case.dtype]
    assert np.all(out[inputs.num_real:] == 0)


@pytest.mark.parametrize("index,case", list(enumerate(DECODE)), ids=[c.id for c in DECODE])
def test_decode_native(index, case):
    inputs = make_inputs(case, zlib.crc32(case.id.encode()) + 1, stacked=index % 2 == 1,
                         pad_rows=2, pad_seqs=2)
    q, k, v, tables, seq_lens, _, _ = inputs.args
    out = paged_attention(q, k, v, tables, seq_lens, scale=case.head_dim ** -0.5,
                          layer=inputs.layer, num_splits=1 + index % 3)
    out = np.asarray(out, np.float32)
    assert rel_error(out, inputs) < TOLERANCE[case.dtype]
    assert np.all(out[inputs.num_real:] == 0)
