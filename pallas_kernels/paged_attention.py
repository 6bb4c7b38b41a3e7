"""Decode-only paged attention in Pallas: one query token per sequence, GQA-aware.

Algorithm: PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023): keys and values live in fixed-size blocks of a shared
pool, found through a per-sequence block table. The softmax is computed in one pass over key
chunks with the online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022),
accumulating in float32. The query heads of one KV head (its GQA group) form the rows of one
program, so each K/V chunk is read once per KV head; with num_splits > 1 the context is split
across programs and the partial softmax states are merged afterwards (split-K, as JAX's own
GPU paged_attention and vLLM's PagedAttention V2). The semantics are those of
pallas_kernels.reference.ragged_paged_attention_reference with one query per sequence.

GPU lowering: the kernel targets Pallas's Triton lowering (`plgpu.CompilerParams`). It exists
in jax 0.10 and 0.11 (the lent H200 runs jax 0.11.2), where 0.11 deprecates it in favour of
Mosaic GPU; a Mosaic GPU port is a later step. Interpret mode (`interpret=True`, the only mode
on a CPU) accepts programs the Triton lowering rejects, so the Triton rules are kept by
construction and checked by the wrapper (see pallas_kernels.validation): power-of-two arrays,
dot operands with every dimension >= 16 (the query group is padded to 16 rows here, e.g. 3 ->
16 for SmolLM2), no TPU-only API, block tables and the layer read by ref indexing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import validation as val
from pallas_kernels.kv_loop import attend_chunks, normalise

DEFAULT_BLOCK_K = 64


def _decode_kernel(layer_ref, seq_lens_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale,
                   block_k, block_size, num_splits, scaled, kv_dtype, window, softcap):
    # layer_ref: int32 [1]; seq_lens_ref: int32 [S]; bt_ref: int32 [S, max_blocks]
    # q_ref: [S, KVH, Gp, D]; k_ref, v_ref: [L, NB, block_size, KVH, D]
    # scaled: refs start with ks_ref, vs_ref [L, NB, block_size, KVH] (a quantized pool)
    # out_refs, num_splits == 1: (o_ref [S, KVH, Gp, D],)
    #           num_splits > 1: (m_ref f32 [P, S, KVH, Gp], l_ref f32 [P, S, KVH, Gp],
    #                            acc_ref f32 [P, S, KVH, Gp, D])
    ks_ref, vs_ref = refs[:2] if scaled else (None, None)
    out_refs = refs[2:] if scaled else refs
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len = seq_lens_ref[s]
    n = (seq_len + block_k - 1) // block_k
    first = 0 if window is None else jnp.maximum(seq_len - window, 0) // block_k  # window's chunk
    per = (n - first + num_splits - 1) // num_splits
    lo = jnp.minimum(first + j * per, n)
    hi = jnp.minimum(lo + per, n)
    q = q_ref[s, h]                                                   # [Gp, D]
    pos = jnp.full((q.shape[0],), seq_len - 1, jnp.int32)
    m, l, acc = attend_chunks(q, k_ref, v_ref, bt_ref, layer=layer_ref[0], seq=s, kv_head=h,
                              pos=pos, kv_len=seq_len, chunk_lo=lo, chunk_hi=hi, scale=scale,
                              block_k=block_k, block_size=block_size, ks_ref=ks_ref,
                              vs_ref=vs_ref, kv_dtype=kv_dtype, window=window,
                              softcap=softcap)
    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[s, h] = normalise(l, acc).astype(o_ref.dtype)
    else:
        m_ref, l_ref, acc_ref = out_refs
        m_ref[j, s, h] = m
        l_ref[j, s, h] = l
        acc_ref[j, s, h] = acc


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_splits", "num_warps",
                                             "num_stages", "interpret", "kv_dtype", "window",
                                             "softcap"))
def _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, layer, scales, *, scale,
                     block_k, num_splits, num_warps, num_stages, interpret, kv_dtype, window, softcap):
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    gp = val.padded_group(group)
    qp = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    if gp != group:
        qp = jnp.pad(qp, ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    rows = (num_seqs, num_kv_heads, gp)
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((*rows, head_dim), q.dtype)]
    else:
        part = (num_splits, *rows)
        out_shape = [jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32),
                     jax.ShapeDtypeStruct((*part, head_dim), jnp.float32)]
    kernel = functools.partial(_decode_kernel, scale=scale, block_k=block_k, block_size=block_size,
                               num_splits=num_splits, scaled=scales is not None, kv_dtype=kv_dtype,
                               window=window, softcap=softcap)
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(num_seqs, num_kv_heads, num_splits),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="paged_attention_decode",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), seq_lens, block_tables, qp, k_cache, v_cache,
      *(scales or ()))
    if num_splits == 1:
        out = outs[0]
    else:  # merge the splits' softmax states (m, l, acc)
        m, l, acc = outs
        w = jnp.exp(m - jnp.max(m, axis=0))
        l_all = jnp.sum(w * l, axis=0)
        acc_all = jnp.sum(w[..., None] * acc, axis=0)
        out = (acc_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]).astype(q.dtype)
    return out[:, :, :group].reshape(num_seqs, num_heads, head_dim)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float, layer=None,
                    k_scale=None, v_scale=None, kv_dtype=None, block_k: int = DEFAULT_BLOCK_K,
                    num_splits: int = 1, num_warps: int = 4, num_stages: int = 2,
                    interpret: bool = False, window: int | None = None,
                    softcap: float | None = None):
    """Decode attention: one query token per sequence over its paged context.

    Args:
      q: [num_seqs, num_q_heads, head_dim], float32 / bfloat16 / float16: the query of each
        sequence's last (current) token.
      k_cache, v_cache: q's dtype or a narrower one (validation.KV_DTYPES), [num_blocks,
        block_size, num_kv_heads, head_dim], or stacked [num_layers, num_blocks, block_size,
        num_kv_heads, head_dim] with `layer`; they already hold the current token's K/V.
      block_tables: int32 [num_seqs, max_blocks_per_seq]: logical -> physical block.
      seq_lens: int32 [num_seqs]: context length including the current token; 0 marks a padding
        row, whose output is zeros.
      scale: softmax scale (static Python number, usually head_dim ** -0.5).
      layer: Python int or int32 scalar choosing the layer of a stacked pool (read by ref
        indexing inside the kernel: no layer is copied out); None for a 4-D pool.
      k_scale, v_scale: for an int8 / float8 pool, float [*pool.shape[:-1]] (one scale per
        token and KV head: key = k_cache x k_scale; uint16 arrays hold bfloat16 bits), else
        None.
      kv_dtype: the values' type when k_cache / v_cache hold their bits (uint16 for bfloat16,
        uint8 for float8; each loaded block is bitcast), else None.
      block_k: keys per inner step (power of two >= 16). num_splits: programs per (sequence,
        KV head) along the context (split-K for few, long sequences). num_warps, num_stages:
        Triton launch knobs. interpret: run the kernel in Pallas interpret mode (CPU).
      window: sliding-window attention (static): the last `window` keys only (chunks before
        them are not visited); None: the whole context. softcap: logit soft-capping (static),
        as the oracle's; None: off.
    Returns:
      [num_seqs, num_q_heads, head_dim] in q's dtype.
    Raises:
      ValueError naming the argument for bad shapes, dtypes or knobs (including the Triton
      lowering's rules: head_dim and block_k powers of two >= 16).
    """
    num_kv_heads, _, _, _ = val.check_pool(q, k_cache, v_cache, layer, kv_dtype)
    scales = val.check_scales(k_cache, k_scale, v_scale, kv_dtype)
    rows = val.check_tables(block_tables, seq_lens)
    if q.shape[0] != rows:
        raise ValueError(f"q must have one row per sequence ({rows} block_tables rows), got "
                         f"{q.shape[0]}")
    val.check_knob("block_k", block_k)
    val.check_positive("num_splits", num_splits)
    val.check_launch(num_warps, num_stages)
    scale = val.check_scale(scale)
    k_cache, v_cache, layer, scales, kv_dtype = val.as_stacked(k_cache, v_cache, layer, scales,
                                                               kv_dtype)
    return _paged_attention(q, k_cache, v_cache, block_tables, seq_lens, jnp.asarray(layer),
                            scales, scale=scale, block_k=block_k, num_splits=num_splits,
                            num_warps=num_warps, num_stages=num_stages, interpret=bool(interpret),
                            kv_dtype=kv_dtype, window=val.check_window(window),
                            softcap=val.check_softcap(softcap))
