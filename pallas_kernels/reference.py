"""Pure-jnp paged attention: jaxkv's XLA path, and what the Pallas kernels are tested against.

Semantics follow vLLM's ragged (varlen) paged attention as used by its V1 attention backends:
the query tokens of sequence s are rows query_start_loc[s] .. query_start_loc[s+1] and are the
LAST positions of its seq_lens[s]-token context, causal among themselves.

How it computes (all in float32, one online softmax (Milakov & Gimelshein 2018; FlashAttention,
Dao et al. 2022) over two kinds of keys):
  1. the cached prefix of each sequence (positions before this step's tokens), in chunks of
     CHUNK_TOKENS keys with trip counts set by the prefix lengths (0 for fresh prefills):
     - a prefill chunk of MIN_SEGMENT_QUERY or more tokens is cut into segments of
       SEGMENT_ROWS query rows; each segment gathers the prefix once per key chunk and
       attends with GEMMs (the varlen tiling of FlashAttention-2, Dao 2023), so a long chunk
       over a long cached prefix costs GEMMs, not a gather per query row;
     - every other row (decodes) gathers its own prefix, memory O(num_tokens x chunk);
  2. this step's own tokens, read back from the pool at their slots and attended densely with a
     block-diagonal causal mask, in key tiles of at most KEY_TILE rows: one GEMM per tile
     instead of a per-row copy of the context.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

CHUNK_TOKENS = 128
KEY_TILE = 128
SEGMENT_ROWS = 32     # query rows of one sequence that share one gather of its prefix
MIN_SEGMENT_QUERY = 4  # sequences with at least this many query tokens take the segment path


def _merge(state, s, v, bias):
    """Online-softmax update of (m, l, acc) with scores s [T, K, G, C], additive 0/-inf mask
    bias [T, 1, 1, C] and per-row values v [T, C, K, D]."""
    m, l, acc = state
    s = s + bias
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
    pv = jnp.einsum("tkgc,tckd->tkgd", p, v)
    return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv


def _dense_tile(qf, k, v, bias):
    """Softmax pieces (m, l, acc) of rows qf [T, K, G, D] over shared keys k/v [S, K, D] with
    an additive 0/-inf mask bias [T, S]; KV-head-major so both products are plain batched
    GEMMs. (A boolean select in place of the bias runs 3-4x slower on XLA:CPU.)"""
    t, nk, g, d = qf.shape
    bias = bias[None, :, None, :]
    qk = qf.transpose(1, 0, 2, 3).reshape(nk, t * g, d)
    s = jnp.einsum("kqd,ksd->kqs", qk, k.transpose(1, 0, 2)).reshape(nk, t, g, -1) + bias
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    acc = jnp.einsum("kqs,ksd->kqd", p.reshape(nk, t * g, -1), v.transpose(1, 0, 2))
    return (m.transpose(1, 0, 2), jnp.sum(p, axis=-1).transpose(1, 0, 2),
            acc.reshape(nk, t, g, d).transpose(1, 0, 2, 3))


def _combine(a, b):
    """Merge two partial softmax states (m, l, acc) over disjoint key sets."""
    m = jnp.maximum(a[0], b[0])
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    wa = jnp.where(jnp.isfinite(a[0]), jnp.exp(a[0] - m_safe), 0.0)
    wb = jnp.where(jnp.isfinite(b[0]), jnp.exp(b[0] - m_safe), 0.0)
    return m, wa * a[1] + wb * b[1], wa[..., None] * a[2] + wb[..., None] * b[2]


class RaggedMetadata(NamedTuple):
    """Per-row facts of one step, shared by every layer (computed once per step)."""
    tables: jax.Array      # int32 [T, max_blocks + chunk_blocks]: the row's block table
    prefix: jax.Array      # int32 [T]: cached keys the per-row path shows the row (0: none)
    slot_block: jax.Array  # int32 [T]: block holding the row's own K/V
    slot_offset: jax.Array  # int32 [T]
    bias: jax.Array        # float32 [T, T]: 0 where row t may see step token s, else -inf
    valid: jax.Array       # bool [T]
    seq_id: jax.Array      # int32 [T]: the row's sequence
    seg_tables: jax.Array  # int32 [max_seqs, max_blocks + chunk_blocks]
    seg_seq: jax.Array     # int32 [S]: sequence of segment j
    seg_row: jax.Array     # int32 [S]: its first query row
    seg_prefix: jax.Array  # int32 [S]: cached keys its rows see
    num_segments: jax.Array  # int32 []: how many of the S segments are real


def ragged_metadata(num_tokens: int, block_size: int, block_tables, seq_lens, query_start_loc,
                    num_seqs, *, chunk_tokens: int = CHUNK_TOKENS,
                    segment_rows: int = SEGMENT_ROWS) -> RaggedMetadata:
    """Row metadata of a step; arguments as in ragged_paged_attention_reference.

    Sequences with at least MIN_SEGMENT_QUERY query tokens and a cached prefix are cut into
    segments of segment_rows query rows (the last may be shorter); the prefix attention of a
    segment gathers its sequence's prefix once and attends with GEMMs (the segment path).
    Every other row gathers its own prefix (the per-row path: decodes, short chunks).
    """
    max_seqs, max_blocks = block_tables.shape
    cb = max(1, min(max_blocks, chunk_tokens // block_size))
    r = max(1, min(segment_rows, num_tokens))
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    valid = rows < query_start_loc[num_seqs[0]]
    seq_id = jnp.clip(jnp.searchsorted(query_start_loc[1:], rows, side="right"), 0, max_seqs - 1)
    q_len = query_start_loc[seq_id + 1] - query_start_loc[seq_id]
    pos = seq_lens[seq_id] - q_len + (rows - query_start_loc[seq_id])  # absolute position
    # Segment path: which sequences, and where their segments start.
    seq_q = query_start_loc[1:] - query_start_loc[:-1]
    seq_prefix = seq_lens - seq_q
    segmented = ((jnp.arange(max_seqs) < num_seqs[0]) & (seq_q >= MIN_SEGMENT_QUERY)
                 & (seq_prefix > 0))
    nseg = jnp.where(segmented, (seq_q + r - 1) // r, 0)
    ends = jnp.cumsum(nseg)
    num_seg_max = num_tokens // r + min(max_seqs, num_tokens // MIN_SEGMENT_QUERY) + 1
    j = jnp.arange(num_seg_max, dtype=jnp.int32)
    seg_seq = jnp.clip(jnp.searchsorted(ends, j, side="right"), 0, max_seqs - 1).astype(jnp.int32)
    seg_row = query_start_loc[seg_seq] + (j - (ends - nseg)[seg_seq]) * r
    prefix = jnp.where(valid & ~segmented[seq_id], seq_lens[seq_id] - q_len, 0)
    tables = jnp.pad(block_tables[seq_id], ((0, 0), (0, cb)))
    slot_block = jnp.take_along_axis(tables, (pos // block_size)[:, None], axis=1)[:, 0]
    see = (valid[:, None] & valid[None, :] & (seq_id[:, None] == seq_id[None, :])
           & (pos[None, :] <= pos[:, None]))
    bias = jnp.where(see, 0.0, -jnp.inf).astype(jnp.float32)
    # Materialise the arrays: left to fusion, XLA:CPU recomputes the whole mask (searchsorted,
    # gathers, compares) for every element of every [K, T, G, S] loop that uses it, which made
    # attention 3-4x slower (an optimization_barrier is expanded before fusion on CPU). A loop
    # with a data-dependent trip count (1 if any row is real, else 0: everything masked) is a
    # boundary XLA does not fuse through.
    any_real = (query_start_loc[num_seqs[0]] > 0).astype(jnp.int32)
    arrays = (tables, prefix, slot_block, pos % block_size, bias, valid, seq_id.astype(jnp.int32),
              jnp.pad(block_tables, ((0, 0), (0, cb))), seg_seq, seg_row.astype(jnp.int32),
              seq_prefix[seg_seq].astype(jnp.int32), ends[-1].astype(jnp.int32))
    empty = tuple(jnp.full_like(a, -jnp.inf) if a is bias else jnp.zeros_like(a) for a in arrays)
    return RaggedMetadata(*jax.lax.fori_loop(0, any_real, lambda i, _: arrays, empty))


def _prefix_attention(qf, k_cache, v_cache, layer, tables, prefix, cb, block_size):
    """Softmax state (m, l, acc) of rows qf [R, K, G, D] over their cached prefixes, gathered
    per row from the pool in chunks of cb blocks; the trip count follows the longest prefix."""
    rows, nk, g, d = qf.shape
    ct = cb * block_size

    def chunk(c, st):
        blk = jax.lax.dynamic_slice_in_dim(tables, c * cb, cb, axis=1)  # [R, cb]
        k = k_cache[layer, blk].reshape(rows, ct, nk, d).astype(jnp.float32)
        v = v_cache[layer, blk].reshape(rows, ct, nk, d).astype(jnp.float32)
        s = jnp.einsum("tkgd,tckd->tkgc", qf, k)
        kpos = c * ct + jnp.arange(ct, dtype=jnp.int32)
        bias = jnp.where(kpos[None, :] < prefix[:, None], 0.0, -jnp.inf)[:, None, None, :]
        return _merge(st, s, v, bias)

    init = (jnp.full((rows, nk, g), -jnp.inf, jnp.float32), jnp.zeros((rows, nk, g), jnp.float32),
            jnp.zeros((rows, nk, g, d), jnp.float32))
    return jax.lax.fori_loop(0, (jnp.max(prefix) + ct - 1) // ct, chunk, init)


def _segment_attention(qf, k_cache, v_cache, layer, md, state, cb, block_size, seg_rows):
    """The segment path: for each real segment, gather its sequence's prefix once per chunk of
    cb blocks and attend its rows with GEMMs; the result replaces those rows of state (whose
    per-row prefix was 0). Trip counts: the real segments, then each one's prefix chunks."""
    num_tokens, nk, g, d = qf.shape
    ct = cb * block_size
    r = max(1, min(seg_rows, num_tokens))

    def segment(j, st):
        s, start, p = md.seg_seq[j], md.seg_row[j], md.seg_prefix[j]
        lo = jnp.minimum(start, num_tokens - r)  # the last segment may end at the last row
        rows = lo + jnp.arange(r, dtype=jnp.int32)
        mine = (md.seq_id[rows] == s) & md.valid[rows] & (rows >= start)
        q = jax.lax.dynamic_slice_in_dim(qf, lo, r)
        table = md.seg_tables[s]

        def chunk(c, acc):
            blk = jax.lax.dynamic_slice_in_dim(table, c * cb, cb)
            k = k_cache[layer, blk].reshape(ct, nk, d).astype(jnp.float32)
            v = v_cache[layer, blk].reshape(ct, nk, d).astype(jnp.float32)
            kpos = c * ct + jnp.arange(ct, dtype=jnp.int32)
            bias = jnp.where(mine[:, None] & (kpos < p)[None, :], 0.0, -jnp.inf)
            return _combine(acc, _dense_tile(q, k, v, bias))

        init = (jnp.full((r, nk, g), -jnp.inf, jnp.float32), jnp.zeros((r, nk, g), jnp.float32),
                jnp.zeros((r, nk, g, d), jnp.float32))
        part = jax.lax.fori_loop(0, (p + ct - 1) // ct, chunk, init)
        out = []
        for x, y in zip(st, part):
            old = jax.lax.dynamic_slice_in_dim(x, lo, r)
            keep = mine.reshape((r,) + (1,) * (x.ndim - 1))
            out.append(jax.lax.dynamic_update_slice_in_dim(x, jnp.where(keep, y, old), lo, 0))
        return tuple(out)

    return jax.lax.fori_loop(0, md.num_segments, segment, state)


def _step_attention(qf, k_new, v_new, md, state, key_tile):
    """This step's own keys k_new/v_new [T, K, D], dense, in key tiles of key_tile rows; the
    trip count covers only the real rows (a 100-token step padded to 512 visits one tile of
    128). A last tile that would run past the end is shifted back and its repeated keys
    masked."""
    num_tokens = qf.shape[0]
    kt = min(key_tile, num_tokens)
    cols = jnp.arange(kt, dtype=jnp.int32)

    def tile(i, st):
        start = i * kt
        lo = jnp.minimum(start, num_tokens - kt)
        k = jax.lax.dynamic_slice_in_dim(k_new, lo, kt)
        v = jax.lax.dynamic_slice_in_dim(v_new, lo, kt)
        bias = jax.lax.dynamic_slice_in_dim(md.bias, lo, kt, axis=1)
        bias = jnp.where((lo + cols >= start)[None, :], bias, -jnp.inf)
        return _combine(st, _dense_tile(qf, k, v, bias))

    return jax.lax.fori_loop(0, (jnp.sum(md.valid.astype(jnp.int32)) + kt - 1) // kt, tile, state)


def ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     num_seqs, *, scale: float, layer=None,
                                     metadata: RaggedMetadata | None = None,
                                     chunk_tokens: int = CHUNK_TOKENS, key_tile: int = KEY_TILE,
                                     segment_rows: int = SEGMENT_ROWS):
    """Ragged paged attention over a block-paged KV pool.

    Args:
      q: [num_tokens, num_q_heads, head_dim] float.
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], or stacked
        [num_layers, num_blocks, block_size, num_kv_heads, head_dim] with `layer` an int32
        scalar (or Python int) choosing the layer inside the gathers; no layer is sliced out.
        They must already hold this step's K/V (jaxkv.attention.write_kv runs first).
      block_tables: int32 [max_num_seqs, max_blocks]; row s maps sequence s's logical blocks
        to physical ones (padding entries point at the null block 0).
      seq_lens: int32 [max_num_seqs]: context length including this step's tokens; 0 = padding.
      query_start_loc: int32 [max_num_seqs + 1], non-decreasing; padding rows repeat the end.
      num_seqs: int32 [1]: how many rows of the per-sequence arrays are real.
      scale: softmax scale (usually head_dim ** -0.5).
      metadata: ragged_metadata(...) of these arguments, when the caller shares it between
        layers (it is computed here otherwise), made with the same chunk_tokens and
        segment_rows.
      chunk_tokens, key_tile, segment_rows: tiling knobs (results agree to rounding).
    Returns:
      [num_tokens, num_q_heads, head_dim] in q.dtype; rows past the last sequence are zeros.
    num_q_heads must be a multiple of num_kv_heads (grouped-query attention).
    """
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    md = metadata if metadata is not None else ragged_metadata(
        num_tokens, block_size, block_tables, seq_lens, query_start_loc, num_seqs,
        chunk_tokens=chunk_tokens, segment_rows=segment_rows)
    cb = md.tables.shape[1] - block_tables.shape[1]  # blocks per prefix chunk
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * scale

    # 1. Cached prefix. Per row (decodes, short chunks), chunk by chunk, in two row groups with
    # their own trip counts: the scheduler puts running requests (decodes) first, so in a step
    # that mixes decodes with prefill chunks the second group usually has no per-row prefix and
    # its loop runs zero times. Then per segment of the longer chunks (see ragged_metadata).
    split = num_tokens // 8 if num_tokens >= 128 else num_tokens
    parts = []
    for lo, hi in ((0, split), (split, num_tokens)):
        if hi > lo:
            parts.append(_prefix_attention(qf[lo:hi], k_cache, v_cache, layer, md.tables[lo:hi],
                                           md.prefix[lo:hi], cb, block_size))
    state = tuple(jnp.concatenate(xs) for xs in zip(*parts)) if len(parts) > 1 else parts[0]
    state = _segment_attention(qf, k_cache, v_cache, layer, md, state, cb, block_size,
                               segment_rows)

    # 2. This step's own tokens, dense with a block-diagonal causal mask.
    k_new = k_cache[layer, md.slot_block, md.slot_offset].astype(jnp.float32)  # [T, K, D]
    v_new = v_cache[layer, md.slot_block, md.slot_offset].astype(jnp.float32)
    state = _step_attention(qf, k_new, v_new, md, state, key_tile)

    _, l, acc = state
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
