"""The gpu-marked checks without pytest (the device image may lack it): each compiles a kernel
natively (interpret=False) and compares it with the float32 reference. Used by test_gpu.py and
by benchmarks/gpu_check.sh's fallback runner (`python -m tests.pallas.native_checks`)."""

from __future__ import annotations

import sys
import time
import zlib

import jax
import numpy as np

from pallas_kernels import paged_attention, ragged_paged_attention
from tests.pallas.cases import TOLERANCE, full_product, make_inputs, pairwise, rel_error

RAGGED = pairwise(full_product())
DECODE = pairwise(full_product(kinds=("decode",)))


def check_ragged(index, case, interpret=False):
    with jax.default_matmul_precision("highest"):  # no TF32 in the XLA reference
        inputs = make_inputs(case, zlib.crc32(case.id.encode()), stacked=index % 2 == 0)
    out = ragged_paged_attention(*inputs.args, scale=case.head_dim ** -0.5, layer=inputs.layer,
                                 interpret=interpret)
    out = np.asarray(out, np.float32)
    err = rel_error(out, inputs)
    assert err < TOLERANCE[case.dtype], f"{case.id}: relative error {err:.2e}"
    assert np.all(out[inputs.num_real:] == 0), f"{case.id}: padding rows not zero"


def check_decode(index, case, interpret=False):
    with jax.default_matmul_precision("highest"):
        inputs = make_inputs(case, zlib.crc32(case.id.encode()) + 1, stacked=index % 2 == 1,
                             pad_rows=2, pad_seqs=2)
    q, k, v, tables, seq_lens, _, _ = inputs.args
    out = paged_attention(q, k, v, tables, seq_lens, scale=case.head_dim ** -0.5,
                          layer=inputs.layer, num_splits=1 + index % 3, interpret=interpret)
    out = np.asarray(out, np.float32)
    err = rel_error(out, inputs)
    assert err < TOLERANCE[case.dtype], f"{case.id}: relative error {err:.2e}"
    assert np.all(out[inputs.num_real:] == 0), f"{case.id}: padding rows not zero"


def main(argv=None) -> int:
    """--interpret --limit N: the CPU dry run of gpu_check.sh (interpret mode, N cases each)."""
    argv = sys.argv[1:] if argv is None else argv
    interpret = "--interpret" in argv
    limit = int(argv[argv.index("--limit") + 1]) if "--limit" in argv else None
    failed = passed = 0
    for name, fn, cases in (("ragged", check_ragged, RAGGED), ("decode", check_decode, DECODE)):
        for i, case in enumerate(cases[:limit]):
            t0 = time.perf_counter()
            try:
                fn(i, case, interpret)
                passed += 1
                print(f"PASSED {name}[{case.id}] {time.perf_counter() - t0:.2f}s", flush=True)
            except Exception as e:  # report every case, then fail at the end
                failed += 1
                print(f"FAILED {name}[{case.id}]: {type(e).__name__}: {e}", flush=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
