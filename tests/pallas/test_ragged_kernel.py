"""ragged_paged_attention (Pallas, interpret mode) against the float32 reference: decode-only,
prefill-only and mixed batches over the factor grid of tests/pallas/cases.py. CI runs a
pairwise-covering subset; the full product is marked slow."""

import zlib

import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention
from tests.pallas.cases import TOLERANCE, full_product, make_inputs, pairwise, pairs_of, rel_error

ALL = full_product()
CI = pairwise(ALL)
KNOBS = [(16, 16), (32, 32), (64, 16)]  # (block_m, block_k), cycled over the cases


def check(case, index):
    seed = zlib.crc32(case.id.encode())  # fresh inputs per case, reproducible
    inputs = make_inputs(case, seed, stacked=index % 2 == 0)
    block_m, block_k = KNOBS[index % len(KNOBS)]
    out = ragged_paged_attention(*inputs.args, scale=case.head_dim ** -0.5, layer=inputs.layer,
                                 block_m=block_m, block_k=block_k, interpret=True)
    out = np.asarray(out, np.float32)
    assert out.shape == inputs.ref.shape and out.dtype == np.float32
    err = rel_error(out, inputs)
    assert err < TOLERANCE[case.dtype], f"{case.id}: relative error {err:.2e}"
    # Interpret mode fills outputs with NaN before the call: every padding row must be written.
    assert np.all(out[inputs.num_real:] == 0), "padding rows must be zeros"


@pytest.mark.parametrize("index,case", list(enumerate(CI)), ids=[c.id for c in CI])
def test_ci_cases(index, case):
    check(case, index)


@pytest.mark.slow
@pytest.mark.parametrize("index,case", list(enumerate(ALL)), ids=[c.id for c in ALL])
def test_full_product(index, case):
    check(case, index)


def test_ci_set_covers_every_pair():
    want = set().union(*(pairs_of(c) for c in ALL))
    got = set().union(*(pairs_of(c) for c in CI))
    assert got == want
    assert len(CI) <= 32, len(CI)
