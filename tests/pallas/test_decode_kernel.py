"""paged_attention (decode-only Pallas kernel, interpret mode) against the float32 reference:
one query token per sequence, padding sequences (seq_lens 0 -> zeros), split-K on and off,
over the factor grid of tests/pallas/cases.py less the batch kind. CI runs a pairwise-covering
subset; the full product is marked slow."""

import zlib

import numpy as np
import pytest

from pallas_kernels import paged_attention
from tests.pallas.cases import TOLERANCE, full_product, make_inputs, pairwise, rel_error

ALL = full_product(kinds=("decode",))
CI = pairwise(ALL)
KNOBS = [(16, 1), (32, 3), (64, 2)]  # (block_k, num_splits), cycled over the cases


def check(case, index):
    seed = zlib.crc32(case.id.encode()) + 1
    # One q row per block_tables row: the padding sequences are the padding rows.
    inputs = make_inputs(case, seed, stacked=index % 2 == 1, pad_rows=2, pad_seqs=2)
    q, k, v, tables, seq_lens, _, _ = inputs.args
    block_k, splits = KNOBS[index % len(KNOBS)]
    out = paged_attention(q, k, v, tables, seq_lens, scale=case.head_dim ** -0.5,
                          layer=inputs.layer, block_k=block_k, num_splits=splits, interpret=True)
    out = np.asarray(out, np.float32)
    assert out.shape == inputs.ref.shape
    err = rel_error(out, inputs)
    assert err < TOLERANCE[case.dtype], f"{case.id}: relative error {err:.2e}"
    assert np.all(out[inputs.num_real:] == 0), "padding sequences must give zeros"


@pytest.mark.parametrize("index,case", list(enumerate(CI)), ids=[c.id for c in CI])
def test_ci_cases(index, case):
    check(case, index)


@pytest.mark.slow
@pytest.mark.parametrize("index,case", list(enumerate(ALL)), ids=[c.id for c in ALL])
def test_full_product(index, case):
    check(case, index)
