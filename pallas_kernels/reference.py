"""Pure-jnp paged attention: jaxkv's XLA path, and what the Pallas kernels are tested against.

Semantics follow vLLM's ragged (varlen) paged attention as used by its V1 attention backends:
the query tokens of sequence s are rows query_start_loc[s] .. query_start_loc[s+1] and are the
LAST positions of its seq_lens[s]-token context, causal among themselves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Context is visited in chunks of this many blocks x block_size tokens, with an online
# softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022) over the chunks, so
# memory stays O(num_tokens x chunk) however long the context, and the trip count follows the
# longest context in this step rather than the padded block-table width.
CHUNK_TOKENS = 128


def ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     num_seqs, *, scale: float, layer=None,
                                     chunk_tokens: int = CHUNK_TOKENS):
    """Ragged paged attention over a block-paged KV pool.

    Args:
      q: [num_tokens, num_q_heads, head_dim] float.
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], or stacked
        [num_layers, num_blocks, block_size, num_kv_heads, head_dim] with `layer` an int32
        scalar choosing the layer (read by indexing inside the gather; never sliced out).
      block_tables: int32 [max_num_seqs, max_blocks]; row s maps sequence s's logical blocks
        to physical ones (padding entries point at the null block 0).
      seq_lens: int32 [max_num_seqs]: context length including this step's tokens; 0 = padding.
      query_start_loc: int32 [max_num_seqs + 1], non-decreasing; padding rows repeat the end.
      num_seqs: int32 [1]: how many rows of the per-sequence arrays are real.
      scale: softmax scale (usually head_dim ** -0.5).
    Returns:
      [num_tokens, num_q_heads, head_dim] in q.dtype; rows past the last sequence are zeros.
    Accumulates in float32. num_q_heads must be a multiple of num_kv_heads (GQA).
    """
    if layer is None:
        k_cache, v_cache = k_cache[None], v_cache[None]
        layer = jnp.int32(0)
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_seqs, max_blocks = block_tables.shape
    cb = max(1, min(max_blocks, chunk_tokens // block_size))  # blocks per chunk
    ct = cb * block_size

    # Which sequence each token row belongs to, and its absolute position.
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    n_real = query_start_loc[num_seqs[0]]
    seq_id = jnp.clip(jnp.searchsorted(query_start_loc[1:], rows, side="right"), 0, max_seqs - 1)
    valid = rows < n_real
    q_len = query_start_loc[seq_id + 1] - query_start_loc[seq_id]
    pos = seq_lens[seq_id] - q_len + (rows - query_start_loc[seq_id])  # [T]
    limit = jnp.where(valid, pos + 1, 0)  # keys at positions < limit are visible

    tables = jnp.pad(block_tables[seq_id], ((0, 0), (0, cb)))  # [T, max_blocks + cb]
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * scale
    max_len = jnp.max(jnp.where(jnp.arange(max_seqs) < num_seqs[0], seq_lens, 0))
    num_chunks = (max_len + ct - 1) // ct

    def body(c, carry):
        m, l, acc = carry
        blk = jax.lax.dynamic_slice_in_dim(tables, c * cb, cb, axis=1)  # [T, cb]
        k = k_cache[layer, blk].reshape(num_tokens, ct, num_kv_heads, head_dim)
        v = v_cache[layer, blk].reshape(num_tokens, ct, num_kv_heads, head_dim)
        s = jnp.einsum("tkgd,tckd->tkgc", qf, k.astype(jnp.float32))
        kpos = c * ct + jnp.arange(ct, dtype=jnp.int32)
        mask = (kpos[None, :] < limit[:, None])[:, None, None, :]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("tkgc,tckd->tkgd", p, v.astype(jnp.float32))
        return m_new, l, acc

    init = (jnp.full((num_tokens, num_kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def dense_causal_attention(q, k, v, *, scale: float):
    """Plain causal attention for one sequence, for tests: q [T, H, D], k/v [T, KVH, D]."""
    t, h, d = q.shape
    g = h // k.shape[1]
    k = jnp.repeat(k, g, axis=1).astype(jnp.float32)
    v = jnp.repeat(v, g, axis=1).astype(jnp.float32)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k) * scale
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None], s, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v).astype(q.dtype)
