"""The key loop both Pallas kernels share: K/V chunks gathered through the block table by ref
indexing, and an online softmax over them in float32.

Algorithm: PagedAttention (Kwon et al., SOSP 2023) for the block-table indirection; the online
softmax of Milakov & Gimelshein (2018) as used by FlashAttention (Dao et al., 2022) for the
chunked, single-pass normalisation. As vLLM's Triton "unified attention" kernel, every key
position of a chunk finds its physical slot on its own (block_tables[seq, pos // block_size],
pos % block_size), so a chunk (block_k keys, a power of two >= 16) need not align with the
pool's blocks and any block size works.

Runs inside a kernel body only (the refs are Pallas refs); Triton-lowerable by construction:
2-D dots of same-dtype operands with every dimension >= 16, power-of-two arrays, no TPU API.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.validation import scale_values, view_as

# A finite minus-infinity: exp(NEG - m) underflows to 0, and NEG - NEG is 0, never NaN.
NEG = -1e30


def dot(a, b, *, trans_b: bool = False):
    """a [M, K] @ b [K, N] (or b [N, K] with trans_b) -> float32 [M, N]; float32 inputs use the
    IEEE path (Triton would otherwise pick TF32), 16-bit inputs accumulate in float32."""
    if a.dtype == jnp.float32:
        return plgpu.dot(a, b, trans_b=trans_b, allow_tf32=False)
    return plgpu.dot(a, b, trans_b=trans_b)


def attend_chunks(q, k_ref, v_ref, bt_ref, *, layer, seq, kv_head, pos, kv_len, chunk_lo,
                  chunk_hi, scale: float, block_k: int, block_size: int, ks_ref=None,
                  vs_ref=None, kv_dtype=None, window: int | None = None,
                  softcap: float | None = None):
    """Online softmax of query rows over key chunks [chunk_lo, chunk_hi) of one sequence.

    q: [M, head_dim] float32 / bfloat16 / float16 (M a power of two >= 16); each loaded K/V
      block is cast to its dtype.
    k_ref, v_ref: refs [num_layers, num_blocks, block_size, num_kv_heads, head_dim]; only
      k_ref[layer, block, offset, kv_head, :] rows are read (no layer is copied out).
    bt_ref: ref int32 [rows, max_blocks]; row `seq` maps logical to physical blocks.
    layer, seq, kv_head: int32 scalars. pos: int32 [M], row m sees key positions <= pos[m]
      (causal) and < kv_len (int32 scalar).
    ks_ref, vs_ref: refs [num_layers, num_blocks, block_size, num_kv_heads] of per-token,
      per-KV-head scales for a quantized pool (int8 / float8: key = stored x scale), or None.
      They are folded into the scores (s x k_scale per key) and into the probabilities
      (p x v_scale per key) rather than into the loaded blocks: a multiply per key, not per
      element, and the dots keep their operand types. uint16 scales are bfloat16 bits.
    kv_dtype: the type of the values when the refs hold their bits (uint8 / uint16), else None.
    window: sliding-window attention (static): row m sees keys > pos[m] - window only.
    softcap: logit soft-capping (static): scores become softcap x tanh(scores / softcap).
    Returns (m, l, acc): float32 [M] running max, [M] softmax denominator, [M, head_dim]
    unnormalised output; l == 0 where a row saw no key.
    """
    rows, head_dim = q.shape
    max_blocks = bt_ref.shape[1]
    limit = jnp.minimum(pos, kv_len - 1)[:, None]  # [M, 1]: last visible key per row
    first = None if window is None else (pos - window + 1)[:, None]  # first visible key

    def body(c, carry):
        m, l, acc = carry
        kpos = c * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # [block_k]
        blk = bt_ref[seq, jnp.minimum(kpos // block_size, max_blocks - 1)]     # [block_k]
        off = kpos % block_size
        # Cast to q's dtype (a no-op unless the pool is narrower: bfloat16, int8, float8).
        k = view_as(k_ref[layer, blk, off, kv_head, :], kv_dtype).astype(q.dtype)  # [block_k, D]
        v = view_as(v_ref[layer, blk, off, kv_head, :], kv_dtype).astype(q.dtype)  # [block_k, D]
        s = dot(q, k, trans_b=True) * scale                                     # [M, block_k]
        if ks_ref is not None:
            s = s * scale_values(ks_ref[layer, blk, off, kv_head]).astype(jnp.float32)[None, :]
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        mask = kpos[None, :] <= limit
        if first is not None:
            mask &= kpos[None, :] >= first
        s = jnp.where(mask, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        pv = p if vs_ref is None else \
            p * scale_values(vs_ref[layer, blk, off, kv_head]).astype(jnp.float32)[None, :]
        acc = alpha[:, None] * acc + dot(pv.astype(v.dtype), v)                 # [M, D]
        return m_new, l, acc

    init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    return jax.lax.fori_loop(chunk_lo, chunk_hi, body, init)


def normalise(l, acc):
    """acc / l per row, 0 for rows that saw no key (l == 0): float32 [M, head_dim]."""
    return acc / jnp.where(l > 0, l, 1.0)[:, None]
