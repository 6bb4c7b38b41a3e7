"""Matmuls of a decode step's rows on the CPU through jaxkv's C++ kernels (XLA FFI calls).

A step of a few rows (a decode of a few sequences; the sampler's LM head on its rows) only
reads the weights: on XLA:CPU each such dot runs on one thread (~14 GB/s on the 2-core
machine) where the streaming kernel (linear.cc) reads every weight from memory once with
all cores, in contiguous chunks of rows, several side by side for one to four rows (~26-29
GB/s; a chunk is read again from cache for each further group of 4 rows, 2 when transposed),
and one call takes the several weights of one input (q/k/v, gate/up). From 17 to 128 rows
(a decode of 17-64 sequences, a step of up to 128 tokens) the product is compute: the GEMM
kernel (gemm.cc) keeps 8 rows x 48 columns of sums in registers over blocks of the weight
held in L1, prefetching the next, the columns shared among the cores. The model uses them
(LlamaModel.cpu_matmul) for float32 weights, steps of at most MAX_ROWS rows, without tensor
parallelism; everything else stays an XLA dot. Built and loaded with the attention kernel
(jaxkv/cpu_kernels/build.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cpu_kernels.build import build_error, load

TARGET = "jaxkv_linear"  # the streaming kernel: 1 to STREAM_MAX_ROWS rows, or transposed
GEMM_TARGET = "jaxkv_gemm"  # the GEMM kernel: STREAM_MAX_ROWS + 1 to MAX_ROWS rows
STREAM_MAX_ROWS = 16  # from 9 to 16 rows the 30 layers' matmuls of SmolLM2 take 34-41 ms
# against XLA's 44-46 on the 2-core Xeon
MAX_ROWS = 128  # the model's threshold: every row count the kernels take
MAX_ROWS_TRANSPOSED = 4  # the LM head's: from 8 rows XLA's dot reads the table as fast
CHUNK_ROWS = 64  # rows of a [K, N] weight per work item (linear.cc's kChunkRows)
# The partial sums of a [K, N] call, ceil(K / CHUNK_ROWS) x T x sum(N) float32, live in a
# scratch buffer of the calling thread that is kept for its next call; calls that would need
# more are refused (an untied LM head of a large vocabulary at 16 rows: XLA's dot runs it).
MAX_SCRATCH_BYTES = 32 << 20


def _refusal(x, weights, transposed: bool) -> str | None:
    """Why the kernel does not take these (None when it does), naming the argument."""
    if not 1 <= len(weights) <= 8:
        return f"cpu matmul: 1 to 8 weights, got {len(weights)}"
    most = STREAM_MAX_ROWS if transposed else MAX_ROWS
    if x.ndim != 2 or x.shape[0] > most or x.dtype != jnp.float32:
        return f"cpu matmul: x must be float32 [T <= {most}, K], got {x.dtype}{list(x.shape)}"
    k = x.shape[1]
    for w in weights:
        if w.ndim != 2 or w.dtype != jnp.float32 or w.shape[-1 if transposed else 0] != k:
            return (f"cpu matmul: a weight must be float32 [{'N, ' if transposed else ''}"
                    f"{k}{'' if transposed else ', N'}], got {w.dtype}{list(w.shape)}")
    if not transposed and x.shape[0] <= STREAM_MAX_ROWS:
        scratch = -(-k // CHUNK_ROWS) * x.shape[0] * sum(w.shape[1] for w in weights) * 4
        if scratch > MAX_SCRATCH_BYTES:
            return (f"cpu matmul: the partial sums of x {list(x.shape)} with these weights "
                    f"would take {scratch / 2**20:.1f} MiB of scratch (limit "
                    f"{MAX_SCRATCH_BYTES >> 20} MiB)")
    return None


def applies(x, *weights, transposed: bool = False) -> bool:
    """Whether the model runs these through matmul() (else XLA dots): float32 x [T, K] with
    1 <= T <= MAX_ROWS (MAX_ROWS_TRANSPOSED when transposed), 1 to 8 float32 weights [K, N]
    (or [N, K] transposed) whose partial sums fit MAX_SCRATCH_BYTES at up to STREAM_MAX_ROWS
    rows, the kernels built."""
    most = MAX_ROWS_TRANSPOSED if transposed else MAX_ROWS
    return (_refusal(x, weights, transposed) is None and 1 <= x.shape[0] <= most
            and load() is not None)


def matmul(x, *weights, transposed: bool = False) -> tuple:
    """(x @ W for W in weights): x float32 [T, K] (T <= MAX_ROWS = 128; T <= 16 transposed),
    each weight float32 [K, N_m] (or [N_m, K] with transposed=True: x @ W^T, an embedding
    table as the LM head) -> a tuple of float32 [T, N_m], one per weight (1 to 8 weights).
    Up to STREAM_MAX_ROWS rows (or transposed) the streaming kernel runs, from 17 rows the
    GEMM kernel.

    Every output element is a sum in a fixed order (streaming [K, N]: over K in chunks of
    CHUNK_ROWS rows, each in order, then the chunks in order; transposed: 16 lane sums over
    K, added pairwise, then the K % 16 tail; GEMM: over K in order, one fused multiply-add
    at a time), so the result does not depend on the thread count or on x's other rows; it
    may differ from XLA's dot, and between the two kernels, in the last bits.
    Raises RuntimeError if the kernels are not built, ValueError for shapes or types they
    do not take (x [T, K] with T > 128, or > 16 transposed, not float32, a weight that does
    not fit x, more than MAX_SCRATCH_BYTES of partial sums at up to 16 rows)."""
    if load() is None:
        raise RuntimeError(f"cpu matmul kernel unavailable: {build_error()}")
    if why := _refusal(x, weights, transposed):
        raise ValueError(why)
    outs = tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[0] if transposed else w.shape[1]),
                                      jnp.float32) for w in weights)
    if not transposed and x.shape[0] > STREAM_MAX_ROWS:
        return tuple(jax.ffi.ffi_call(GEMM_TARGET, outs)(x, *weights))
    return tuple(jax.ffi.ffi_call(TARGET, outs)(x, *weights, transposed=np.int64(transposed)))
