"""jaxkv's XLA attention path: ragged paged attention in pure jnp, tuned for XLA:CPU.

The `xla` attention backend (the default off a GPU). Semantics are exactly those of the oracle
pallas_kernels.reference.ragged_paged_attention_reference (vLLM's ragged paged attention: the
query tokens of sequence s are rows query_start_loc[s] .. query_start_loc[s+1], the LAST
positions of its seq_lens[s]-token context, causal among themselves), against which it is
tested; this file is about speed.

How it computes: every key is read back from the pool (write_kv has stored this step's K/V),
in chunks of CHUNK_TOKENS keys, all in float32 with one online softmax (Milakov & Gimelshein
2018; FlashAttention, Dao et al. 2022). Rows take one of two paths:
  - segment path: a sequence with more than one query token (a prefill chunk) is cut into
    segments of SEGMENT_ROWS query rows, as FlashAttention-2's varlen tiling (Dao
    2023) does; a segment gathers its sequence's keys once per chunk, up to its last row's
    position (causal chunks past that are never visited), and attends with GEMMs, so a long
    chunk over a long cached prefix costs GEMMs, not a copy of the context per query row;
  - per-row path: a decode row (one query token) gathers its own context, with a trip count
    set by the longest such context. In a step of more than max_num_seqs rows the decode rows
    (at most one per sequence) are packed into max_num_seqs slots wherever they sit, so a
    step that mixes decodes with a 512-token chunk gathers for max_num_seqs rows, not 512.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from pallas_kernels.validation import scale_values, view_as

CHUNK_TOKENS = 128
SEGMENT_ROWS = 32  # query rows of one sequence that share one gather of its keys


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


def _dense_tile(qf, k, v, bias, softcap=None):
    """Softmax pieces (m, l, acc) of rows qf [T, K, G, D] over shared keys k/v [S, K, D] with
    an additive 0/-inf mask bias [T, S]; KV-head-major so both products are plain batched
    GEMMs. (A boolean select in place of the bias runs 3-4x slower on XLA:CPU.)"""
    t, nk, g, d = qf.shape
    bias = bias[None, :, None, :]
    qk = qf.transpose(1, 0, 2, 3).reshape(nk, t * g, d)
    s = jnp.einsum("kqd,ksd->kqs", qk, k.transpose(1, 0, 2)).reshape(nk, t, g, -1)
    s = (s if softcap is None else jnp.tanh(s / softcap) * softcap) + bias
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
    row_idx: jax.Array     # int32 [P]: rows of the per-row loop: all T (P = T <= max_seqs) or
    #                        the decode rows packed (P = max_seqs; T marks an unused slot)
    tables: jax.Array      # int32 [P, max_blocks + chunk_blocks]: their block tables
    ctx: jax.Array         # int32 [P]: keys each sees: its position + 1 for a decode row,
    #                        0 for segmented, padding and unused slots
    pos: jax.Array         # int32 [T]: the row's absolute position
    valid: jax.Array       # bool [T]
    seq_id: jax.Array      # int32 [T]: the row's sequence
    seg_tables: jax.Array  # int32 [max_seqs, max_blocks + chunk_blocks]
    seg_seq: jax.Array     # int32 [S]: sequence of segment j
    seg_row: jax.Array     # int32 [S]: its first query row
    seg_ctx: jax.Array     # int32 [S]: keys its last row sees (the inner trip count's bound)
    num_segments: jax.Array  # int32 []: how many of the S segments are real


def ragged_metadata(num_tokens: int, block_size: int, block_tables, seq_lens, query_start_loc,
                    num_seqs, *, chunk_tokens: int = CHUNK_TOKENS,
                    segment_rows: int = SEGMENT_ROWS) -> RaggedMetadata:
    """Row metadata of a step; arguments as in xla_ragged_paged_attention."""
    max_seqs, max_blocks = block_tables.shape
    cb = max(1, min(max_blocks, chunk_tokens // block_size))
    r = _segment_size(segment_rows, num_tokens)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    valid = rows < query_start_loc[num_seqs[0]]
    seq_id = jnp.clip(jnp.searchsorted(query_start_loc[1:], rows, side="right"), 0, max_seqs - 1)
    q_len = query_start_loc[seq_id + 1] - query_start_loc[seq_id]
    pos = seq_lens[seq_id] - q_len + (rows - query_start_loc[seq_id])  # absolute position
    # Segments: ceil(q / r) per segmented sequence, numbered in sequence order.
    seq_q = query_start_loc[1:] - query_start_loc[:-1]
    segmented = (jnp.arange(max_seqs) < num_seqs[0]) & (seq_q >= 2)
    nseg = jnp.where(segmented, (seq_q + r - 1) // r, 0)
    ends = jnp.cumsum(nseg)
    num_seg_max = num_tokens // r + min(max_seqs, num_tokens // 2) + 1
    j = jnp.arange(num_seg_max, dtype=jnp.int32)
    seg_seq = jnp.clip(jnp.searchsorted(ends, j, side="right"), 0, max_seqs - 1).astype(jnp.int32)
    first = j - (ends - nseg)[seg_seq]  # the segment's index within its sequence
    seg_row = query_start_loc[seg_seq] + first * r
    seg_ctx = jnp.minimum(seq_lens[seg_seq], seq_lens[seg_seq] - seq_q[seg_seq] + (first + 1) * r)
    decode = valid & ~segmented[seq_id]
    if num_tokens <= max_seqs:
        row_idx = rows
    else:  # at most one decode row per sequence
        row_idx = jnp.nonzero(decode, size=max_seqs, fill_value=num_tokens)[0].astype(jnp.int32)
    at = jnp.minimum(row_idx, num_tokens - 1)
    ctx = jnp.where((row_idx < num_tokens) & decode[at], pos[at] + 1, 0)
    # Materialise the arrays: left to fusion, XLA:CPU recomputes them (searchsorted, gathers,
    # compares) for every element of every loop that uses them, which made attention 3-4x
    # slower (an optimization_barrier is expanded before fusion on CPU). A loop
    # with a data-dependent trip count (1 if any row is real, else 0: everything masked) is a
    # boundary XLA does not fuse through.
    any_real = (query_start_loc[num_seqs[0]] > 0).astype(jnp.int32)
    padded = jnp.pad(block_tables, ((0, 0), (0, cb)))  # a chunk may run past the last block
    arrays = (row_idx, padded[seq_id[at]], ctx, pos, valid, seq_id.astype(jnp.int32), padded,
              seg_seq, seg_row.astype(jnp.int32), seg_ctx.astype(jnp.int32),
              ends[-1].astype(jnp.int32))
    empty = tuple(jnp.zeros_like(a) for a in arrays)
    return RaggedMetadata(*jax.lax.fori_loop(0, any_real, lambda i, _: arrays, empty))


def _segment_size(segment_rows: int, num_tokens: int) -> int:
    """Rows per segment: segment_rows, or the whole step when it is shorter."""
    return max(1, min(segment_rows, num_tokens))


def _empty_state(rows, nk, g, d):
    return (jnp.full((rows, nk, g), -jnp.inf, jnp.float32), jnp.zeros((rows, nk, g), jnp.float32),
            jnp.zeros((rows, nk, g, d), jnp.float32))


def _load(cache, scales, kv_dtype, layer, blk, shape):
    """Blocks blk of one layer as float32 of `shape` (..., keys, K, D): the gathered values
    (seen as kv_dtype when the pool holds their bits), dequantized with their per-token,
    per-KV-head scales when the pool has them (the multiply fuses into the gather)."""
    x = view_as(cache[layer, blk], kv_dtype).reshape(shape).astype(jnp.float32)
    if scales is None:
        return x
    s = scale_values(scales[layer, blk]).reshape(shape[:-1]).astype(jnp.float32)
    return x * s[..., None]


def _row_attention(qf, pool, layer, tables, ctx, cb, block_size, window=None, softcap=None):
    """Softmax state (m, l, acc) of rows qf [R, K, G, D] over their first ctx keys (the last
    `window` of them with a sliding window), gathered per row from the pool (k, v, k_scale,
    v_scale, kv_dtype) in chunks of cb blocks; the trip count follows the longest ctx."""
    rows, nk, g, d = qf.shape
    ct = cb * block_size
    k_cache, v_cache, k_scale, v_scale, kv_dtype = pool

    def chunk(c, st):
        blk = jax.lax.dynamic_slice_in_dim(tables, c * cb, cb, axis=1)  # [R, cb]
        k = _load(k_cache, k_scale, kv_dtype, layer, blk, (rows, ct, nk, d))
        v = _load(v_cache, v_scale, kv_dtype, layer, blk, (rows, ct, nk, d))
        s = jnp.einsum("tkgd,tckd->tkgc", qf, k)
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        kpos = c * ct + jnp.arange(ct, dtype=jnp.int32)
        seen = kpos[None, :] < ctx[:, None]
        if window is not None:
            seen &= kpos[None, :] >= ctx[:, None] - window
        bias = jnp.where(seen, 0.0, -jnp.inf)[:, None, None, :]
        return _merge(st, s, v, bias)

    return jax.lax.fori_loop(0, (jnp.max(ctx) + ct - 1) // ct, chunk, _empty_state(rows, nk, g, d))


def _segment_attention(qf, pool, layer, md, state, cb, block_size, seg_rows, window=None,
                       softcap=None):
    """The segment path: for each real segment, gather its sequence's keys once per chunk of
    cb blocks, up to its last row, and attend its rows causally with GEMMs; the result
    replaces those rows of state. Trip counts: the real segments, then each one's chunks."""
    num_tokens, nk, g, d = qf.shape
    ct = cb * block_size
    r = _segment_size(seg_rows, num_tokens)
    k_cache, v_cache, k_scale, v_scale, kv_dtype = pool

    def segment(j, st):
        s, start = md.seg_seq[j], md.seg_row[j]
        lo = jnp.minimum(start, num_tokens - r)  # the last segment may end at the last row
        rows = lo + jnp.arange(r, dtype=jnp.int32)
        mine = (md.seq_id[rows] == s) & md.valid[rows] & (rows >= start)
        last = jnp.where(mine, md.pos[rows], -1)  # the causal limit of each row
        q = jax.lax.dynamic_slice_in_dim(qf, lo, r)
        table = md.seg_tables[s]

        def chunk(c, acc):
            blk = jax.lax.dynamic_slice_in_dim(table, c * cb, cb)
            k = _load(k_cache, k_scale, kv_dtype, layer, blk, (ct, nk, d))
            v = _load(v_cache, v_scale, kv_dtype, layer, blk, (ct, nk, d))
            kpos = c * ct + jnp.arange(ct, dtype=jnp.int32)
            seen = kpos[None, :] <= last[:, None]
            if window is not None:
                seen &= kpos[None, :] > last[:, None] - window
            bias = jnp.where(seen, 0.0, -jnp.inf)
            return _combine(acc, _dense_tile(q, k, v, bias, softcap))

        trips = (md.seg_ctx[j] + ct - 1) // ct
        part = jax.lax.fori_loop(0, trips, chunk, _empty_state(r, nk, g, d))
        out = []
        for x, y in zip(st, part):
            old = jax.lax.dynamic_slice_in_dim(x, lo, r)
            keep = mine.reshape((r,) + (1,) * (x.ndim - 1))
            out.append(jax.lax.dynamic_update_slice_in_dim(x, jnp.where(keep, y, old), lo, 0))
        return tuple(out)

    return jax.lax.fori_loop(0, md.num_segments, segment, state)


def xla_ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                               num_seqs, *, scale: float, layer=None, k_scale=None,
                               v_scale=None, kv_dtype=None, metadata: RaggedMetadata | None = None,
                               chunk_tokens: int = CHUNK_TOKENS,
                               segment_rows: int = SEGMENT_ROWS, window: int | None = None,
                               softcap: float | None = None):
    """Ragged paged attention over a block-paged KV pool: arguments, shapes and result as
    pallas_kernels.reference.ragged_paged_attention_reference (the layer of a stacked pool is
    chosen inside the gathers; no layer is sliced out), plus:
      metadata: ragged_metadata(...) of these arguments, when the caller shares it between
        layers (it is computed here otherwise), made with the same chunk_tokens and
        segment_rows.
      chunk_tokens, segment_rows: tiling knobs (results agree to rounding).
      window, softcap: sliding-window attention and logit soft-capping, as the oracle's.
    k_scale, v_scale, kv_dtype are those of the oracle: the scales of an int8 / float8 pool, or
    None; the values' type when the pool holds their bits, or None.
    """
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
        k_scale, v_scale = (None, None) if k_scale is None else (k_scale[None], v_scale[None])
    pool = (k_cache, v_cache, k_scale, v_scale, kv_dtype)
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    md = metadata if metadata is not None else ragged_metadata(
        num_tokens, block_size, block_tables, seq_lens, query_start_loc, num_seqs,
        chunk_tokens=chunk_tokens, segment_rows=segment_rows)
    cb = md.tables.shape[1] - block_tables.shape[1]  # blocks per key chunk
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * scale

    packed = md.row_idx.shape[0] < num_tokens
    qr = qf[jnp.minimum(md.row_idx, num_tokens - 1)] if packed else qf
    state = _row_attention(qr, pool, layer, md.tables, md.ctx, cb, block_size, window, softcap)
    if packed:  # back to their rows; unused slots (index T) are dropped
        state = tuple(e.at[md.row_idx].set(x, mode="drop")
                      for e, x in zip(_empty_state(num_tokens, num_kv_heads, group, head_dim),
                                      state))
    state = _segment_attention(qf, pool, layer, md, state, cb, block_size, segment_rows, window,
                               softcap)
    _, l, acc = state
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)

