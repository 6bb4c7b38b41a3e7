"""The oracle: ragged paged attention written to be obviously correct, not fast.

Semantics follow vLLM's ragged (varlen) paged attention as used by its V1 attention backends:
the query tokens of sequence s are rows query_start_loc[s] .. query_start_loc[s+1] and are the
LAST positions of its seq_lens[s]-token context, causal among themselves. Both Pallas kernels
and jaxkv's XLA path (jaxkv/attention/xla_ragged.py) are tested against this function.

How: gather every sequence's whole context through its block table, give each query row its
sequence's keys, mask keys past the row's position, softmax in float32. Memory is
2 x num_tokens x max_blocks x block_size x num_q_heads x head_dim float32 values (K and V
repeated to every query head): for tests and smoke checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.validation import scale_values, view_as


def ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     num_seqs, *, scale: float, layer=None, k_scale=None,
                                     v_scale=None, kv_dtype=None, window: int | None = None,
                                     softcap: float | None = None):
    """Ragged paged attention over a block-paged KV pool (dense gather, float32 softmax).

    Args:
      q: [num_tokens, num_q_heads, head_dim] float.
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], or stacked
        [num_layers, num_blocks, block_size, num_kv_heads, head_dim] with `layer` choosing one.
        They already hold this step's K/V.
      block_tables: int32 [max_num_seqs, max_blocks]; row s maps sequence s's logical blocks
        to physical ones (padding entries point at the null block 0).
      seq_lens: int32 [max_num_seqs]: context length including this step's tokens; 0 = padding.
      query_start_loc: int32 [max_num_seqs + 1], non-decreasing; padding rows repeat the end.
      num_seqs: int32 [1]: how many rows of the per-sequence arrays are real.
      scale: softmax scale (usually head_dim ** -0.5).
      k_scale, v_scale: for a quantized (int8 / float8) pool, float [*k_cache.shape[:-1]]: the
        stored value times its token's and KV head's scale is the key (value); None otherwise.
        uint16 scales hold bfloat16 bits.
      kv_dtype: the values' type when the pool holds their bits (uint16 / uint8), else None.
      window: a row at position p sees keys p - window + 1 .. p (sliding window); None: all.
      softcap: scores become softcap x tanh(scores / softcap) before the mask; None: off.
    Returns:
      [num_tokens, num_q_heads, head_dim] in q.dtype; rows past the last sequence are zeros.
    num_q_heads must be a multiple of num_kv_heads (grouped-query attention).
    """
    k_cache, v_cache = view_as(k_cache, kv_dtype), view_as(v_cache, kv_dtype)
    if k_scale is not None:  # dequantize the whole pool: obviously right, not fast
        k_cache = k_cache.astype(jnp.float32) * scale_values(k_scale).astype(jnp.float32)[..., None]
        v_cache = v_cache.astype(jnp.float32) * scale_values(v_scale).astype(jnp.float32)[..., None]
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_seqs, max_blocks = block_tables.shape
    context = max_blocks * block_size
    rows = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(query_start_loc[1:], rows, side="right"), 0, max_seqs - 1)
    real = rows < query_start_loc[num_seqs[0]]
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = seq_lens[seq] - q_len + rows - query_start_loc[seq]  # the row's absolute position

    def gather(cache):  # [num_tokens, context, num_q_heads, head_dim]: each row's own context
        ctx = cache[block_tables].reshape(max_seqs, context, num_kv_heads, head_dim)
        return jnp.repeat(ctx[seq], num_heads // num_kv_heads, axis=2).astype(jnp.float32)

    k, v = gather(k_cache), gather(v_cache)
    s = jnp.einsum("thd,tchd->thc", q.astype(jnp.float32) * scale, k)
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    kpos = jnp.arange(context)[None, :]
    visible = kpos <= pos[:, None]  # causal, and only this sequence
    if window is not None:
        visible &= kpos > pos[:, None] - window
    s = jnp.where(visible[:, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("thc,tchd->thd", p, v)
    return jnp.where(real[:, None, None], out, 0.0).astype(q.dtype)
