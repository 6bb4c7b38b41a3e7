"""Kernel test cases: the factor grid, a pairwise-covering CI subset, and random inputs.

Each case is a batch of sequences drawn fresh from its own seed: a block pool of random values,
block tables that are random permutations of the pool's blocks (never contiguous), bucket
padding (extra token rows, extra sequence rows pointing at the null block 0), and the
reference output in float32 computed by pallas_kernels.reference from the same (for bfloat16,
bf16-cast) inputs.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import ragged_paged_attention_reference

KINDS = ("decode", "prefill", "mixed")
CONTEXTS = ("1", "bs-1", "bs", "bs+1", "long")
GROUPS = (1, 3, 8)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (8, 16, 32)
DTYPES = ("float32", "bfloat16")
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
NUM_KV_HEADS = 2
# Jitted: op-by-op, the reference's loops cost ~3x more than compiling it once per case.
_reference = jax.jit(ragged_paged_attention_reference, static_argnames=("scale", "layer"))


class Case(NamedTuple):
    kind: str
    context: str
    group: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def id(self) -> str:
        return (f"{self.kind}-ctx{self.context}-g{self.group}-d{self.head_dim}-"
                f"bs{self.block_size}-{self.dtype}")

    def context_len(self) -> int:
        bs = self.block_size
        return {"1": 1, "bs-1": bs - 1, "bs": bs, "bs+1": bs + 1, "long": 4 * bs + 5}[self.context]


def full_product(kinds=KINDS) -> list[Case]:
    return [Case(*c) for c in itertools.product(kinds, CONTEXTS, GROUPS, HEAD_DIMS, BLOCK_SIZES, DTYPES)]


def pairs_of(case: Case) -> set:
    return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}


def pairwise(cases: list[Case]) -> list[Case]:
    """Greedy pairwise covering subset (deterministic): every value pair of every two factors
    that occurs in `cases` occurs in the result."""
    todo = set().union(*(pairs_of(c) for c in cases))
    chosen = []
    while todo:
        best = max(cases, key=lambda c: len(pairs_of(c) & todo))
        chosen.append(best)
        todo -= pairs_of(best)
    return chosen


class Inputs(NamedTuple):
    args: tuple      # kernel arguments (q, k_cache, v_cache, block_tables, seq_lens, qsl, num_seqs)
    layer: int | None
    ref: np.ndarray  # float32 [num_tokens, heads, head_dim]: reference output
    num_real: int    # real token rows (the rest is padding)


def batch_shape(case: Case, rng) -> tuple[list[int], list[int]]:
    """(context lengths, query lengths) of the case's sequences."""
    c = case.context_len()
    other = int(rng.integers(1, 3 * case.block_size))
    if case.kind == "decode":
        return [c, c, other], [1, 1, 1]
    if case.kind == "prefill":
        return [c, other], [c, other]
    # mixed: a decode, a fresh prefill, a prefill chunk over a cached prefix, another decode
    chunk = max(1, c // 2)
    return [c, c, c + other, other], [1, c, chunk + 1, 1]


def make_inputs(case: Case, seed: int, *, stacked: bool, pad_rows: int = 3, pad_seqs: int = 2) -> Inputs:
    rng = np.random.default_rng(seed)
    ctx, qlen = batch_shape(case, rng)
    bs, d, kvh = case.block_size, case.head_dim, NUM_KV_HEADS
    heads = kvh * case.group
    nbs = [-(-c // bs) for c in ctx]
    max_blocks = max(nbs) + 1
    num_blocks = sum(nbs) + 5
    perm = rng.permutation(np.arange(1, num_blocks))
    max_seqs = len(ctx) + pad_seqs
    tables = np.zeros((max_seqs, max_blocks), np.int32)
    seq_lens = np.zeros(max_seqs, np.int32)
    qsl = np.zeros(max_seqs + 1, np.int32)
    used = t = 0
    for s, (c, n, nb) in enumerate(zip(ctx, qlen, nbs)):
        tables[s, :nb] = perm[used:used + nb]
        used += nb
        seq_lens[s] = c
        t += n
        qsl[s + 1] = t
    qsl[len(ctx) + 1:] = t
    layers = 3 if stacked else 1
    dt = jnp.dtype(case.dtype)
    k = jnp.asarray(rng.standard_normal((layers, num_blocks, bs, kvh, d)), dt)
    v = jnp.asarray(rng.standard_normal((layers, num_blocks, bs, kvh, d)), dt)
    q = jnp.asarray(rng.standard_normal((t + pad_rows, heads, d)), dt)
    layer = 1 if stacked else None
    if not stacked:
        k, v = k[0], v[0]
    tail = (jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(qsl),
            jnp.array([len(ctx)], jnp.int32))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = _reference(*f32, *tail, scale=d ** -0.5, layer=layer)
    return Inputs((q, k, v, *tail), layer, np.asarray(ref), t)


def rel_error(out, inputs: Inputs) -> float:
    """max|out - ref| / max|ref| over the real rows."""
    out = np.asarray(out, np.float32)[:inputs.num_real]
    ref = inputs.ref[:inputs.num_real]
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
