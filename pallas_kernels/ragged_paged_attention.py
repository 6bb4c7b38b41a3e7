"""Ragged paged attention in Pallas: prefill chunks and decodes of many sequences in one call.

Semantics: exactly pallas_kernels.reference.ragged_paged_attention_reference, i.e. vLLM's
ragged (varlen) paged attention of its V1 attention backends: the query tokens of sequence s
are rows query_start_loc[s] .. query_start_loc[s+1] - 1 and are the LAST positions of its
seq_lens[s]-token context, causal among themselves; only the first num_seqs[0] sequences are
real; every other row is bucket padding (its output is zeros here, finite in any case).

Algorithm: PagedAttention's block-table indirection (Kwon et al., SOSP 2023) with
FlashAttention's tiling and online softmax (Dao et al., 2022; Milakov & Gimelshein 2018), laid
out as vLLM's Triton "unified attention" kernel: a program owns one KV head and a tile of
block_m query rows, where a row is a (token, query head of that KV head's group) pair, so the
group is packed densely (GQA: each K/V chunk is read once for all the tile's heads) and a tile
holds block_m // group consecutive tokens of ONE sequence. The tile map (which sequence and
rows each program owns) is computed by the wrapper in plain jnp; programs left over (the grid
is sized for the worst case) own no rows and store nothing. Every row below num_tokens is
written, padding rows with zeros, so the output never holds uninitialised memory.

GPU lowering: the kernel targets Pallas's Triton lowering (`plgpu.CompilerParams`), present in
jax 0.10 and 0.11 (the lent H200 runs jax 0.11.2, which deprecates it in favour of Mosaic GPU;
a Mosaic GPU port is a later step). Interpret mode (`interpret=True`, the only mode on a CPU)
accepts programs that the Triton lowering rejects, so its rules hold by construction and the
wrapper checks them (pallas_kernels.validation): power-of-two arrays, dots of one dtype with
every dimension >= 16, no TPU-only API (no pltpu, no scalar-prefetch grid spec), block tables,
tile map and layer read by ref indexing, float32 accumulation; rows are gathered and stored
with masks (`plgpu.store`) because a tile's rows need not fill it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import validation as val
from pallas_kernels.kv_loop import attend_chunks, normalise

DEFAULT_BLOCK_M = 64
DEFAULT_BLOCK_K = 32
TILE_FIELDS = 5  # seq, first row, end row, position offset, keys visible to the tile


def tile_map(query_start_loc, seq_lens, num_seqs, *, num_tokens: int, block_q: int):
    """int32 [num_tiles, 5] tile map: (seq, q_start, q_end, pos_offset, kv_len) per tile.

    Tile i owns rows q_start .. min(q_start + block_q, q_end) - 1 of sequence seq; a row's
    absolute position is row + pos_offset; its keys are positions <= that and < kv_len.
    Real sequences' tiles come first, then tiles of the padding rows (kv_len 0: zeros), then
    empty tiles (q_start == q_end == num_tokens). num_tiles = cdiv(num_tokens, block_q) +
    max_num_seqs + 1 bounds sum_s cdiv(q_len_s, block_q) + cdiv(padding rows, block_q).
    """
    rows = seq_lens.shape[0]
    n = num_seqs[0]
    qs, qe = query_start_loc[:-1], query_start_loc[1:]
    q_len = jnp.where(jnp.arange(rows) < n, qe - qs, 0)
    count = (q_len + block_q - 1) // block_q
    cum = jnp.cumsum(count)
    total = cum[-1]
    num_tiles = -(-num_tokens // block_q) + rows + 1
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cum, i, side="right"), 0, rows - 1).astype(jnp.int32)
    q0 = qs[seq] + (i - (cum[seq] - count[seq])) * block_q
    q_end = qe[seq]
    pos_off = seq_lens[seq] - q_end
    kv_len = jnp.minimum(q0 + block_q, q_end) + pos_off
    real = i < total
    pad_q0 = query_start_loc[n] + (i - total) * block_q
    pad = ~real & (pad_q0 < num_tokens)
    q0 = jnp.where(real, q0, jnp.where(pad, pad_q0, num_tokens))
    q_end = jnp.where(real, q_end, num_tokens)
    zero = jnp.zeros_like(i)
    return jnp.stack([jnp.where(real, seq, zero), q0, q_end, jnp.where(real, pos_off, zero),
                      jnp.where(real, kv_len, zero)], axis=1).astype(jnp.int32)


def _ragged_kernel(layer_ref, tiles_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale, group,
                   block_m, block_k, block_size, scaled, kv_dtype, window, softcap):
    # layer_ref: int32 [1]; tiles_ref: int32 [num_tiles, 5]; bt_ref: int32 [max_seqs, max_blocks]
    # q_ref, o_ref: [T, H, D]; k_ref, v_ref: [L, NB, block_size, KVH, D]
    # refs: (ks_ref, vs_ref [L, NB, block_size, KVH], o_ref) when scaled, else (o_ref,)
    ks_ref, vs_ref, o_ref = refs if scaled else (None, None, *refs)
    i, h = pl.program_id(0), pl.program_id(1)
    seq, q0, q_end = tiles_ref[i, 0], tiles_ref[i, 1], tiles_ref[i, 2]
    pos_off, kv_len = tiles_ref[i, 3], tiles_ref[i, 4]
    num_tokens, _, head_dim = q_ref.shape
    r = jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    tok = q0 + r // group                                           # [block_m] row -> token
    head = h * group + r % group                                    # [block_m] row -> q head
    valid = (r // group < block_m // group) & (tok < q_end)
    tok_c = jnp.minimum(tok, num_tokens - 1)                        # in bounds for the gather
    q = q_ref[tok_c, head, :]                                       # [block_m, D]
    # With a sliding window the chunks before the tile's first row's window are skipped.
    lo = 0 if window is None else jnp.maximum(q0 + pos_off - window + 1, 0) // block_k
    m, l, acc = attend_chunks(q, k_ref, v_ref, bt_ref, layer=layer_ref[0], seq=seq, kv_head=h,
                              pos=tok + pos_off, kv_len=kv_len, chunk_lo=lo,
                              chunk_hi=(kv_len + block_k - 1) // block_k, scale=scale,
                              block_k=block_k, block_size=block_size, ks_ref=ks_ref,
                              vs_ref=vs_ref, kv_dtype=kv_dtype, window=window,
                              softcap=softcap)
    out = normalise(l, acc).astype(o_ref.dtype)                     # [block_m, D]
    # Masked scatter of the valid rows. The indices are the unclamped (tok, head): distinct for
    # all block_m rows, so interpret mode (which writes masked rows back unchanged, dropping
    # out-of-bounds ones) never sees a masked row collide with a valid one.
    d = jax.lax.broadcasted_iota(jnp.int32, (block_m, head_dim), 1)
    mask = jnp.broadcast_to(valid[:, None], (block_m, head_dim))
    plgpu.store(o_ref.at[tok[:, None], head[:, None], d], out, mask=mask)


@functools.partial(jax.jit, static_argnames=("scale", "block_m", "block_k", "num_warps",
                                             "num_stages", "interpret", "kv_dtype", "window",
                                             "softcap"))
def _ragged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, layer,
            scales, *, scale, block_m, block_k, num_warps, num_stages, interpret, kv_dtype,
            window, softcap):
    num_tokens, num_heads, _ = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    tiles = tile_map(query_start_loc, seq_lens, num_seqs, num_tokens=num_tokens,
                     block_q=block_m // group)
    kernel = functools.partial(_ragged_kernel, scale=scale, group=group, block_m=block_m,
                               block_k=block_k, block_size=block_size, scaled=scales is not None,
                               kv_dtype=kv_dtype, window=window, softcap=softcap)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(tiles.shape[0], num_kv_heads),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="ragged_paged_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), tiles, block_tables, q, k_cache, v_cache,
      *(scales or ()))


def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                           *, scale: float, layer=None, k_scale=None, v_scale=None,
                           kv_dtype=None, block_m: int = DEFAULT_BLOCK_M,
                           block_k: int = DEFAULT_BLOCK_K, num_warps: int = 4,
                           num_stages: int = 2, interpret: bool = False,
                           window: int | None = None,
                           softcap: float | None = None):
    """Ragged paged attention (prefill chunks and decodes together) over a block-paged pool.

    Args:
      q: [num_tokens, num_q_heads, head_dim], float32 / bfloat16 / float16.
      k_cache, v_cache: q's dtype or a narrower one (validation.KV_DTYPES), [num_blocks,
        block_size, num_kv_heads, head_dim], or stacked [num_layers, num_blocks, block_size,
        num_kv_heads, head_dim] with `layer`. They already hold this step's K/V
        (jaxkv.attention.write_kv runs first).
      block_tables: int32 [max_num_seqs, max_blocks]: row s maps sequence s's logical blocks to
        physical ones.
      seq_lens: int32 [max_num_seqs]: context length including this step's tokens.
      query_start_loc: int32 [max_num_seqs + 1], non-decreasing; padding entries repeat the end.
      num_seqs: int32 [1]: how many rows of the per-sequence arrays are real.
      scale: softmax scale (static Python number, usually head_dim ** -0.5).
      layer: Python int or int32 scalar choosing the layer of a stacked pool (read by ref
        indexing: no layer is copied out); None for a 4-D pool.
      k_scale, v_scale: for an int8 / float8 pool, float [*pool.shape[:-1]] (one scale per
        token and KV head: key = k_cache x k_scale; uint16 arrays hold bfloat16 bits), else
        None.
      kv_dtype: the values' type when k_cache / v_cache hold their bits (uint16 for bfloat16,
        uint8 for float8; each loaded block is bitcast), else None.
      block_m: query rows (token x group head) per program, a power of two >= 16 and >= the
        group size. block_k: keys per inner step, a power of two >= 16. num_warps, num_stages:
        Triton launch knobs. interpret: Pallas interpret mode (CPU). window, softcap: as the oracle's.
    Returns:
      [num_tokens, num_q_heads, head_dim] in q's dtype; rows past the last real sequence are 0.
    Raises:
      ValueError naming the argument for bad shapes, dtypes or knobs (including the Triton
      lowering's rules).
    """
    _, group, _, _ = val.check_pool(q, k_cache, v_cache, layer, kv_dtype)
    scales = val.check_scales(k_cache, k_scale, v_scale, kv_dtype)
    rows = val.check_tables(block_tables, seq_lens)
    val.check_int_array("query_start_loc", query_start_loc, 1)
    if query_start_loc.shape[0] != rows + 1:
        raise ValueError(f"query_start_loc must have {rows + 1} entries (block_tables rows + 1), "
                         f"got {query_start_loc.shape[0]}")
    val.check_int_array("num_seqs", num_seqs, 1)
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must have shape (1,), got {num_seqs.shape}")
    val.check_knob("block_m", block_m)
    if block_m < group:
        raise ValueError(f"block_m must be >= the query group size {group}, got {block_m}")
    val.check_knob("block_k", block_k)
    val.check_launch(num_warps, num_stages)
    scale = val.check_scale(scale)
    k_cache, v_cache, layer, scales, kv_dtype = val.as_stacked(k_cache, v_cache, layer, scales,
                                                               kv_dtype)
    return _ragged(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                   jnp.asarray(layer), scales, scale=scale, block_m=block_m, block_k=block_k,
                   num_warps=num_warps, num_stages=num_stages, interpret=bool(interpret),
                   kv_dtype=kv_dtype, window=val.check_window(window),
                   softcap=val.check_softcap(softcap))
