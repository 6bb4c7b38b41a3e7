"""The one attention entry point of the engine, and the slot-mapping K/V write.

`paged_attention` has ragged semantics (prefill chunks and decodes in one call). The backend
is chosen by the engine (`attention_backend`): "xla" runs the pure-jnp reference of
pallas_kernels/reference.py; "pallas" runs the Pallas kernels of pallas_kernels/ behind the
same signature, natively on a GPU and in Pallas interpret mode elsewhere (correct but slow:
for tests, never for serving on a CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from pallas_kernels.paged_attention import paged_attention as decode_attention_kernel
from pallas_kernels.ragged_paged_attention import DEFAULT_BLOCK_M
from pallas_kernels.ragged_paged_attention import ragged_paged_attention as ragged_kernel
from pallas_kernels.reference import ragged_metadata, ragged_paged_attention_reference
from pallas_kernels.validation import next_pow2

from jaxkv.engine_config import resolve_backend  # noqa: F401 - the engine's choice, re-exported


def pallas_interpret() -> bool:
    """Whether the Pallas kernels must run in interpret mode: everywhere but on a GPU."""
    return jax.default_backend() != "gpu"


def write_kv(k_cache, v_cache, k, v, slot_mapping, layer):
    """Write this step's K/V into the stacked pool at their slots.

    k_cache, v_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim];
    k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: int32 [num_tokens],
    slot = block_id * block_size + offset (padding rows point into the null block 0);
    layer: int32 scalar. Returns the updated (k_cache, v_cache): an in-place scatter when the
    pool is donated.
    """
    block_size = k_cache.shape[2]
    blk, off = slot_mapping // block_size, slot_mapping % block_size
    k_cache = k_cache.at[layer, blk, off].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, blk, off].set(v.astype(v_cache.dtype))
    return k_cache, v_cache


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *,
                    scale: float, layer=None, backend: str = "xla", metadata=None,
                    decode_only: bool = False):
    """Ragged paged attention; shapes as in
    pallas_kernels.reference.ragged_paged_attention_reference (q [num_tokens, num_q_heads,
    head_dim] -> out of the same shape).

    backend "xla": the pure-jnp reference; `metadata` (from `attention_metadata`) lets the
    layers of one step share its per-row bookkeeping. backend "pallas": the ragged Pallas
    kernel, or, when the caller promises (static `decode_only`) that every real sequence has
    exactly one query token, so that token row s is sequence s, the decode kernel. Rows past
    the last real sequence are zeros either way.
    """
    if backend == "xla":
        return ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                                query_start_loc, num_seqs, scale=scale,
                                                layer=layer, metadata=metadata)
    if backend != "pallas":
        raise ValueError(f"backend must be 'xla' or 'pallas', got {backend!r}")
    interpret = pallas_interpret()
    if not decode_only:
        group = q.shape[1] // k_cache.shape[-2]  # a tile holds at least one token's group
        return ragged_kernel(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                             num_seqs, scale=scale, layer=layer, interpret=interpret,
                             block_m=max(DEFAULT_BLOCK_M, next_pow2(group)))
    rows = min(q.shape[0], block_tables.shape[0])
    lens = jnp.where(jnp.arange(rows) < num_seqs[0], seq_lens[:rows], 0)  # padding rows -> 0
    out = decode_attention_kernel(q[:rows], k_cache, v_cache, block_tables[:rows], lens,
                                  scale=scale, layer=layer, interpret=interpret)
    return jnp.pad(out, ((0, q.shape[0] - rows), (0, 0), (0, 0)))


def attention_metadata(num_tokens, block_size, block_tables, seq_lens, query_start_loc, num_seqs,
                       backend: str = "xla"):
    """Per-step row metadata shared by all layers (see pallas_kernels.reference.ragged_metadata);
    None for the pallas backend, whose kernels derive their own."""
    if backend != "xla":
        return None
    return ragged_metadata(num_tokens, block_size, block_tables, seq_lens, query_start_loc, num_seqs)

