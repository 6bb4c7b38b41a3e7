"""The one attention entry point of the engine, and the slot-mapping K/V write.

`paged_attention` has ragged semantics (prefill chunks and decodes in one call). The backend
is chosen by the engine (`attention_backend`): "xla" runs the pure-jnp reference of
pallas_kernels/reference.py; "pallas" will run the Pallas kernel behind the same signature.
"""

from __future__ import annotations

from pallas_kernels.reference import ragged_metadata, ragged_paged_attention_reference

from jaxkv.config import ATTENTION_BACKENDS as BACKENDS


def resolve_backend(name: str, platform: str) -> str:
    """auto -> pallas on GPU, xla elsewhere. ValueError for an unknown name."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "pallas":
        # The kernel lands with the Pallas issue; until then no backend claims to run it.
        raise ValueError("attention_backend='pallas' is not available yet; use 'auto' or 'xla'")
    return "xla"  # auto: the Pallas kernel on GPU once it exists, the XLA reference elsewhere


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
                    scale: float, layer=None, backend: str = "xla", metadata=None):
    """Ragged paged attention; shapes as in
    pallas_kernels.reference.ragged_paged_attention_reference (q [num_tokens, num_q_heads,
    head_dim] -> out of the same shape). `metadata` (from `attention_metadata`) lets the layers
    of one step share the per-row bookkeeping."""
    return ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                            query_start_loc, num_seqs, scale=scale, layer=layer,
                                            metadata=metadata)


def attention_metadata(num_tokens, block_size, block_tables, seq_lens, query_start_loc, num_seqs):
    """Per-step row metadata shared by all layers (see pallas_kernels.reference.ragged_metadata)."""
    return ragged_metadata(num_tokens, block_size, block_tables, seq_lens, query_start_loc, num_seqs)

