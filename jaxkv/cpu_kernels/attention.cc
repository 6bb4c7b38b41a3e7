// jaxkv's CPU ragged paged attention: an XLA FFI custom call (see attention.py).
//
// Semantics are those of pallas_kernels/reference.py (vLLM's ragged paged attention): the
// query rows of sequence s are rows query_start_loc[s] .. query_start_loc[s+1]-1, the last
// positions of its seq_lens[s]-token context, causal among themselves; rows past the last
// real sequence get zeros. K/V are read in place from the block-paged pool
// [L, num_blocks, block_size, K, D] through the block tables: nothing is gathered first.
//
// Tiling (FlashAttention-2's varlen tiling, Dao 2023, on CPU vectors): a work item is one KV
// head of up to kRowTile query rows of one sequence (a decode row is an item of one row).
// Its G query heads x rows form a Q tile; keys go by tiles of kKeyTile: each tile of K is
// dequantized into a transposed buffer, so S = Q K^T is a small GEMM whose inner loop runs
// over the tile's keys in SIMD lanes, then an online softmax (Milakov & Gimelshein 2018) and
// acc += P V with D in the lanes. Every K/V row is read once per item, for all its rows and
// query heads. Items are shared by the calling thread and tasks on XLA's intra-op thread pool
// (work_sharing.h: one atomic counter; tasks that start after the work is gone return at once,
// holding only the shared counters).
//
// Pool element types (attribute kind): 0 float32; 1 bfloat16 held as uint16 bits;
// 2 float16; 3 one byte (int8 / float8 bits) decoded through a 256-entry float32 table (lut)
// times per-token, per-KV-head bfloat16 scales (uint16 bits, [L, num_blocks, block_size, K]).
// Kinds 0-2 ignore lut and the scales (1-element dummies).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kKeyTile = 16;      // keys per tile (SIMD lanes of S)
constexpr int kMaxQRows = 32;     // query rows x query heads of one item
constexpr int kMaxHeadDim = 256;
constexpr int kRowsPathMin = 8;   // query rows x heads of one KV head from which an item
                                  // takes the rows path (fewer: the keys path)

// Whether no key of the tile starting at t0 is visible to a row that sees keys below lim.
inline bool kpos_visible_none(int64_t t0, float lim) { return static_cast<float>(t0) >= lim; }

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp(x) for x <= 0 (scores minus their running maximum), vectorizable: 2^(x log2 e) split
// into the nearest integer n and a fraction f in [-1/2, 1/2], a degree-7 Taylor polynomial
// for 2^f (relative error below 1e-8 before float32 rounding), n put in the exponent bits.
// Below -87 it returns exp(-87) ~ 1.6e-38 (callers zero masked keys themselves).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  float p = 1.52527338e-5f;
  p = p * f + 1.54035304e-4f;
  p = p * f + 1.33335581e-3f;
  p = p * f + 9.61812911e-3f;
  p = p * f + 5.55041087e-2f;
  p = p * f + 2.40226507e-1f;
  p = p * f + 6.93147181e-1f;
  p = p * f + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

struct Args {
  const void* q;  // [T, H, D], float32 (q_kind 0) or bfloat16 bits (1) or float16 (2)
  const void* k;  // [L, NB, BS, K, D]
  const void* v;
  const uint16_t* k_scale;  // [L, NB, BS, K] (kind 3)
  const uint16_t* v_scale;
  const float* lut;         // [256] (kind 3)
  const int32_t* tables;    // [S, NT]
  const int32_t* seq_lens;  // [S]
  const int32_t* qsl;       // [S + 1]
  void* out;                // [T, H, D], q's type
  int64_t layer, num_blocks, block_size, kv_heads, group, head_dim, table_cols, kind, q_kind;
  float scale;
};

struct Item {
  int32_t seq, row0, rows, kh0, nh;  // query rows row0 .. row0+rows-1, KV heads kh0 .. kh0+nh-1
  bool keys;                         // the keys path (else the rows path)
};

inline float load_scalar(const void* base, int64_t i, int64_t kind) {
  switch (kind) {
    case 0: return static_cast<const float*>(base)[i];
    case 1: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<float>(static_cast<const _Float16*>(base)[i]);
  }
}

inline void store_row(void* base, int64_t off, const float* x, int64_t n, int64_t kind) {
  switch (kind) {
    case 0: std::memcpy(static_cast<float*>(base) + off, x, n * sizeof(float)); break;
    case 1: {
      uint16_t* dst = static_cast<uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) {  // round to nearest even, as a float32 -> bf16 cast
        uint32_t u;
        std::memcpy(&u, &x[i], sizeof u);
        if ((u & 0x7f800000u) == 0x7f800000u) {
          dst[i] = static_cast<uint16_t>(u >> 16) | ((u & 0xffffu) ? 0x40 : 0);  // inf / nan
        } else {
          dst[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
      }
      break;
    }
    default: {
      _Float16* dst = static_cast<_Float16*>(base) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<_Float16>(x[i]);
    }
  }
}

// Key or value rows of slot `slot` (of the whole pool, layer included), KV heads kh0 ..
// kh0+nh-1, as float32 into out[nh * D].
inline void load_kv(const Args& a, const void* cache, const uint16_t* scales, int64_t slot,
                    int64_t kh0, int64_t nh, float* out) {
  const int64_t D = a.head_dim, n = nh * D;
  const int64_t off = (slot * a.kv_heads + kh0) * D;
  switch (a.kind) {
    case 0: std::memcpy(out, static_cast<const float*>(cache) + off, n * sizeof(float)); break;
    case 1: {
      const uint16_t* src = static_cast<const uint16_t*>(cache) + off;
      for (int64_t d = 0; d < n; ++d) out[d] = bf16_to_float(src[d]);
      break;
    }
    case 2: {
      const _Float16* src = static_cast<const _Float16*>(cache) + off;
      for (int64_t d = 0; d < n; ++d) out[d] = static_cast<float>(src[d]);
      break;
    }
    default: {
      const uint8_t* src = static_cast<const uint8_t*>(cache) + off;
      for (int64_t h = 0; h < nh; ++h) {
        const float s = bf16_to_float(scales[slot * a.kv_heads + kh0 + h]);
        for (int64_t d = 0; d < D; ++d) out[h * D + d] = a.lut[src[h * D + d]] * s;
      }
    }
  }
}

// Per-thread buffers of the items, sized for the largest (about 1 MB per thread).
struct Scratch {
  std::vector<float> q, acc, kt, vt, s;
  Scratch()
      : q(kMaxQRows * kMaxHeadDim), acc(kMaxQRows * kMaxHeadDim),
        kt(kMaxQRows * kMaxHeadDim * kKeyTile), vt(kKeyTile * kMaxQRows * kMaxHeadDim),
        s(kMaxQRows * kKeyTile) {}
};

Scratch& scratch() {
  thread_local Scratch sc;
  return sc;
}

// Sixteen float32 lanes (one AVX-512 register, two AVX2 ones): GCC's generic vectors keep
// the accumulators of the loops below in registers.
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 splat(float x) { return v16{} + x; }

// exp_nonpositive on sixteen lanes (the same polynomial; the nearest integer by the
// 1.5 * 2^23 rounding trick, exact for |t| < 2^22).
inline v16 exp_nonpositive16(v16 x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const v16 t = x * 1.44269504088896341f;
  const v16 n = (t + 12582912.0f) - 12582912.0f;
  const v16 f = t - n;
  v16 p = splat(1.52527338e-5f);
  p = p * f + 1.54035304e-4f;
  p = p * f + 1.33335581e-3f;
  p = p * f + 9.61812911e-3f;
  p = p * f + 5.55041087e-2f;
  p = p * f + 2.40226507e-1f;
  p = p * f + 6.93147181e-1f;
  p = p * f + 1.0f;
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// r[j] = the sum of p[j]'s 16 lanes, for j < 16: a transpose-and-add in four levels of
// two-source shuffles (each level halves the vectors and doubles the keys per vector), so 16
// dot products cost 30 shuffles and 15 adds instead of 16 horizontal sums. The order of each
// lane's additions is fixed.
inline v16 reduce16(const v16* p) {
  const v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i hi1 = lo1 + 8;
  const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i hi2 = lo2 + 4;
  const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i hi3 = lo3 + 2;
  const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i hi4 = lo4 + 1;
  v16 w[8], x[4], y[2];
  for (int m = 0; m < 8; ++m)
    w[m] = __builtin_shuffle(p[2 * m], p[2 * m + 1], lo1) +
           __builtin_shuffle(p[2 * m], p[2 * m + 1], hi1);
  for (int m = 0; m < 4; ++m)
    x[m] = __builtin_shuffle(w[2 * m], w[2 * m + 1], lo2) +
           __builtin_shuffle(w[2 * m], w[2 * m + 1], hi2);
  for (int m = 0; m < 2; ++m)
    y[m] = __builtin_shuffle(x[2 * m], x[2 * m + 1], lo3) +
           __builtin_shuffle(x[2 * m], x[2 * m + 1], hi3);
  return __builtin_shuffle(y[0], y[1], lo4) + __builtin_shuffle(y[0], y[1], hi4);
}

// Lane i + w added to (or maxed with) lane i, for w = 8, 4, 2, 1: the same pairwise order as
// a scalar loop over the lanes, in four shuffles (GCC kept the scalar loop on the stack). The
// sums are the same; GCC may contract the caller's multiply-add around them differently, so an
// output can differ from the scalar loop's build in its last bits (1-4 ulp in 4 of 78 cases).
inline v16 fold16(v16 v, int w) {
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return __builtin_shuffle(v, (lane + w) & 15);
}

inline float hmax16(v16 v) {  // a fixed pairwise order
  for (int w = 8; w > 0; w /= 2) {
    const v16 u = fold16(v, w);
    v = u > v ? u : v;
  }
  return v[0];
}

inline float hsum16(v16 v) {  // a fixed pairwise order
  for (int w = 8; w > 0; w /= 2) v += fold16(v, w);
  return v[0];
}

// softmax_tile on a tile's 16 scores in one vector, keys vis .. 15 masked; the weights go to
// si[0 .. 15].
inline float softmax_tile16(v16 sv, int64_t vis, float* si, float& m, float& l) {
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const v16i keep = lane < static_cast<int32_t>(vis);
  const float m_new = std::max(m, hmax16(keep ? sv : splat(-INFINITY)));
  const float alpha = exp_nonpositive(m - m_new);  // m = -inf: ~0, times zeros
  const v16 pv = keep ? exp_nonpositive16(sv - m_new) : v16{};
  store16(si, pv);
  l = l * alpha + hsum16(pv);
  m = m_new;
  return alpha;
}

// Online-softmax update of a Q-tile row from its tile scores si[0 .. vis-1] (the rest of the
// tile is masked): returns the factor that rescales the row's accumulator, and leaves the
// weights p in si[0 .. kKeyTile-1] (0 for masked keys).
inline float softmax_tile(float* si, int64_t vis, float& m, float& l) {
  if (vis <= 0) {
    std::fill(si, si + kKeyTile, 0.0f);
    return 1.0f;
  }
  float mt = si[0];
  for (int64_t j = 1; j < vis; ++j) mt = std::max(mt, si[j]);
  const float m_new = std::max(m, mt);
  const float alpha = exp_nonpositive(m - m_new);  // m = -inf: ~0, times zeros
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < kKeyTile; ++j) {
    const float p = j < vis ? exp_nonpositive(si[j] - m_new) : 0.0f;
    si[j] = p;
    sum += p;
  }
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// acc[0 .. D-1] = acc * alpha + sum_j p[j * pstride] * vrow[j][voff ..], j < nt, with D in
// the SIMD lanes and the row's accumulator in registers (D_STATIC a multiple of 16), or a
// plain loop for other head sizes.
template <int D_STATIC>
inline void pv_row(float* acc, float alpha, const float* p, int64_t pstride,
                   const float* const* vrow, int64_t voff, int64_t nt, int64_t D) {
  if constexpr (D_STATIC > 0 && D_STATIC % 16 == 0) {
    constexpr int NV = D_STATIC / 16;
    v16 r[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) r[c] = load16(acc + 16 * c) * alpha;
    for (int64_t j = 0; j < nt; ++j) {
      const float pj = p[j * pstride];
      const float* vj = vrow[j] + voff;
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) r[c] += pj * load16(vj + 16 * c);
    }
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) store16(acc + 16 * c, r[c]);
  } else {
    for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
    for (int64_t j = 0; j < nt; ++j) {
      const float pj = p[j * pstride];
      const float* vj = vrow[j] + voff;
      for (int64_t d = 0; d < D; ++d) acc[d] += pj * vj[d];
    }
  }
}

// pv_row for two rows at once (weights p[j * pstride] and p[j * pstride + 1]).
template <int D_STATIC>
inline void pv_rows2(float* acc0, float* acc1, float alpha0, float alpha1, const float* p,
                     int64_t pstride, const float* const* vrow, int64_t nt, int64_t D) {
  if constexpr (D_STATIC > 0 && D_STATIC % 16 == 0) {
    constexpr int NV = D_STATIC / 16;
    v16 r0[NV], r1[NV];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      r0[c] = load16(acc0 + 16 * c) * alpha0;
      r1[c] = load16(acc1 + 16 * c) * alpha1;
    }
    for (int64_t j = 0; j < nt; ++j) {
      const float p0 = p[j * pstride], p1 = p[j * pstride + 1];
      const float* vj = vrow[j];
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) {
        const v16 v = load16(vj + 16 * c);
        r0[c] += p0 * v;
        r1[c] += p1 * v;
      }
    }
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      store16(acc0 + 16 * c, r0[c]);
      store16(acc1 + 16 * c, r1[c]);
    }
  } else {
    pv_row<D_STATIC>(acc0, alpha0, p, pstride, vrow, 0, nt, D);
    pv_row<D_STATIC>(acc1, alpha1, p + 1, pstride, vrow, 0, nt, D);
  }
}

// Where an item reads: its sequence's block table, the layer's first pool slot, the absolute
// position of its first query row, and how many keys its last row sees (keys 0 .. n_keys-1).
struct Span {
  const int32_t* table;
  int64_t layer_slot, first_pos, n_keys;
};

inline Span span_of(const Args& a, const Item& it) {
  const int64_t q_len = a.qsl[it.seq + 1] - a.qsl[it.seq];
  const int64_t first_pos = a.seq_lens[it.seq] - q_len + (it.row0 - a.qsl[it.seq]);
  return {a.tables + static_cast<int64_t>(it.seq) * a.table_cols,
          a.layer * a.num_blocks * a.block_size, first_pos, first_pos + it.rows};
}

// The pool slot (layer included) holding key t of the item's sequence.
inline int64_t slot_of(const Args& a, const Span& sp, int64_t t) {
  return sp.layer_slot + static_cast<int64_t>(sp.table[t / a.block_size]) * a.block_size +
         t % a.block_size;
}

// The K and V rows of keys t0 .. t0+nt-1 for KV heads kh0 .. kh0+nh-1: pointers into a
// float32 pool, or rows converted into kbuf / vbuf ([kKeyTile][nh * D]) for other types.
inline void tile_rows(const Args& a, const Span& sp, int64_t t0, int64_t nt, int64_t kh0,
                      int64_t nh, float* kbuf, float* vbuf, const float** krow,
                      const float** vrow) {
  const int64_t n = nh * a.head_dim;
  for (int64_t j = 0; j < nt; ++j) {
    const int64_t slot = slot_of(a, sp, t0 + j);
    if (a.kind == 0) {
      const int64_t off = (slot * a.kv_heads + kh0) * a.head_dim;
      krow[j] = static_cast<const float*>(a.k) + off;
      vrow[j] = static_cast<const float*>(a.v) + off;
    } else {
      load_kv(a, a.k, a.k_scale, slot, kh0, nh, kbuf + j * n);
      load_kv(a, a.v, a.v_scale, slot, kh0, nh, vbuf + j * n);
      krow[j] = kbuf + j * n;
      vrow[j] = vbuf + j * n;
    }
  }
}

// Writes Q-tile rows i < nq (query row i / (nh * G), head i % (nh * G) of the item's first)
// as acc / l, in q's type.
inline void store_out(const Args& a, const Item& it, const float* acc, const float* l,
                      int64_t nq) {
  const int64_t D = a.head_dim, HG = it.nh * a.group, H = a.kv_heads * a.group;
  float out_row[kMaxHeadDim];
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t r = it.row0 + i / HG, h = it.kh0 * a.group + i % HG;
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out_row[d] = acc[i * D + d] * inv;
    store_row(a.out, (r * H + h) * D, out_row, D, a.q_kind);
  }
}

// Asks the memory system for the K/V rows of the tile starting at t0 (KV heads kh0 ..
// kh0+nh-1) while the current tile is computed: a decode's blocks are scattered over the
// pool, and each block start would otherwise stall the hardware prefetcher.
inline void prefetch_tile(const Args& a, const Span& sp, int64_t t0, int64_t kh0, int64_t nh) {
  const int64_t elem = a.kind == 0 ? 4 : a.kind == 3 ? 1 : 2;
  const int64_t bytes = nh * a.head_dim * elem;
  const int64_t end = std::min<int64_t>(t0 + kKeyTile, sp.n_keys);
  for (int64_t t = t0; t < end; ++t) {
    const int64_t off = (slot_of(a, sp, t) * a.kv_heads + kh0) * a.head_dim * elem;
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(static_cast<const char*>(a.k) + off + b);
      __builtin_prefetch(static_cast<const char*>(a.v) + off + b);
    }
  }
}

// The keys path, for items with few query rows per KV head (decodes): rows row0 ..
// row0+rows-1 of sequence `seq`, KV heads kh0 .. kh0+nh-1 with their G query heads each;
// Q-tile row i = ((row * nh) + head) * G + g. Each key row (all nh heads, contiguous in the
// pool) is dotted with its head's query rows; then an online softmax per tile of kKeyTile
// keys and acc += P V. With a head_dim a multiple of 16, a Q-tile row's 16 scores of a tile
// are computed as 16 vectors of partial sums added across lanes at once (reduce16), and the
// next tile is prefetched row by row during the tile's work (measured on the 2-core Xeon, 64
// sequences x 256 keys, 30 layers, pool cold: 2.3 -> 1.6 ms per layer; warm: 1.1 -> 0.5).
template <int D_STATIC>
void attend_keys(const Args& a, const Item& it) {
  const int64_t D = D_STATIC > 0 ? D_STATIC : a.head_dim;
  const int64_t G = a.group, H = a.kv_heads * G, nh = it.nh, HG = nh * G;
  const int64_t nq = it.rows * HG;
  const Span sp = span_of(a, it);

  Scratch& sc = scratch();
  float* q = sc.q.data();      // [nq][D]
  float* acc = sc.acc.data();  // [nq][D]
  float* kbuf = sc.kt.data();  // converted K rows of the tile [kKeyTile][nh * D]
  float* vbuf = sc.vt.data();  // converted V rows [kKeyTile][nh * D]
  float* s = sc.s.data();      // scores, then weights [nq][kKeyTile]
  float m[kMaxQRows], l[kMaxQRows];
  int64_t limit[kMaxQRows];  // keys 0 .. limit-1 are visible to Q-tile row i
  const float* krow[kKeyTile];
  const float* vrow[kKeyTile];

  for (int64_t i = 0; i < nq; ++i) {
    const int64_t r = it.row0 + i / HG, h = it.kh0 * G + i % HG;
    for (int64_t d = 0; d < D; ++d)
      q[i * D + d] = load_scalar(a.q, (r * H + h) * D + d, a.q_kind) * a.scale;
    limit[i] = sp.first_pos + i / HG + 1;
    m[i] = -INFINITY;
    l[i] = 0.0f;
  }
  std::fill(acc, acc + nq * D, 0.0f);

  for (int64_t t0 = 0; t0 < sp.n_keys; t0 += kKeyTile) {
    const int64_t nt = std::min<int64_t>(kKeyTile, sp.n_keys - t0);
    tile_rows(a, sp, t0, nt, it.kh0, nh, kbuf, vbuf, krow, vrow);
    if constexpr (D_STATIC > 0 && D_STATIC % 16 == 0 && kKeyTile == 16) {
      // Each score: D / 16 vector products summed into one vector of partial sums; the
      // tile's 16 vectors are then summed across lanes at once (reduce16), and the online
      // softmax runs on the tile's scores in one vector.
      constexpr int NV = D_STATIC / 16;
      v16 part[kKeyTile];
      bool asked = false;
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t vis = std::min<int64_t>(limit[i] - t0, nt);
        if (vis <= 0) continue;  // no visible key: weights 0, the accumulator unchanged
        const int64_t off = ((i % HG) / G) * D_STATIC;
        v16 qv[NV];
        for (int c = 0; c < NV; ++c) qv[c] = load16(q + i * D_STATIC + 16 * c);
        // While the first visible row's scores are computed, the next tile's K and V rows are
        // requested row by row (float32 pools), so their misses overlap the rest of this
        // tile's work (one burst for the whole tile stalls on the line-fill buffers).
        const bool ask = !asked && a.kind == 0 && t0 + kKeyTile < sp.n_keys;
        asked = true;
        for (int64_t j = 0; j < nt; ++j) {
          if (ask && t0 + kKeyTile + j < sp.n_keys) {
            const int64_t o = (slot_of(a, sp, t0 + kKeyTile + j) * a.kv_heads + it.kh0) * D_STATIC;
            for (int64_t b = 0; b < nh * D_STATIC; b += 16) {
              __builtin_prefetch(static_cast<const float*>(a.k) + o + b);
              __builtin_prefetch(static_cast<const float*>(a.v) + o + b);
            }
          }
          const float* kr = krow[j] + off;
          v16 d = qv[0] * load16(kr);
          for (int c = 1; c < NV; ++c) d += qv[c] * load16(kr + 16 * c);
          part[j] = d;
        }
        for (int64_t j = nt; j < kKeyTile; ++j) part[j] = v16{};
        float* si = s + i * kKeyTile;
        const float alpha = softmax_tile16(reduce16(part), vis, si, m[i], l[i]);
        pv_row<D_STATIC>(acc + i * D_STATIC, alpha, si, 1, vrow, off, nt, D_STATIC);
      }
      continue;
    }
    prefetch_tile(a, sp, t0 + kKeyTile, it.kh0, nh);
    for (int64_t j = 0; j < nt; ++j) {
      for (int64_t i = 0; i < nq; ++i) {
        const float* kr = krow[j] + ((i % HG) / G) * D;
        const float* qi = q + i * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qi[d] * kr[d];
        s[i * kKeyTile + j] = dot;
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      float* si = s + i * kKeyTile;
      const float alpha = softmax_tile(si, std::min<int64_t>(limit[i] - t0, nt), m[i], l[i]);
      pv_row<D_STATIC>(acc + i * D, alpha, si, 1, vrow, ((i % HG) / G) * D, nt, D);
    }
  }
  store_out(a, it, acc, l, nq);
}

// S^T = K Q^T for the rows path: st[j * kMaxQRows + i] = dot(key row j, query row i) for the
// tile's nt keys, qt = Q^T [D][kMaxQRows]. A key's d-th value is broadcast against the rows'
// d-th query values, four keys at a time (eight independent accumulators). Kept out of line:
// inlined into attend_rows, GCC held the softmax's constants in registers across this loop
// and spilled an accumulator to the stack, a store-to-load chain on every step of d.
__attribute__((noinline)) void scores_rows(const float* qt, const float* const* krow,
                                           int64_t nt, int64_t D, float* st) {
  constexpr int R = kMaxQRows;
  int64_t j = 0;
  for (; j + 4 <= nt; j += 4) {
    v16 a0 = {}, a1 = {}, b0 = {}, b1 = {}, c0 = {}, c1 = {}, e0 = {}, e1 = {};
    const float *k0 = krow[j], *k1 = krow[j + 1], *k2 = krow[j + 2], *k3 = krow[j + 3];
    for (int64_t d = 0; d < D; ++d) {
      const v16 q0 = load16(qt + d * R), q1 = load16(qt + d * R + 16);
      a0 += k0[d] * q0;
      a1 += k0[d] * q1;
      b0 += k1[d] * q0;
      b1 += k1[d] * q1;
      c0 += k2[d] * q0;
      c1 += k2[d] * q1;
      e0 += k3[d] * q0;
      e1 += k3[d] * q1;
    }
    store16(st + j * R, a0);
    store16(st + j * R + 16, a1);
    store16(st + (j + 1) * R, b0);
    store16(st + (j + 1) * R + 16, b1);
    store16(st + (j + 2) * R, c0);
    store16(st + (j + 2) * R + 16, c1);
    store16(st + (j + 3) * R, e0);
    store16(st + (j + 3) * R + 16, e1);
  }
  for (; j < nt; ++j) {
    v16 a0 = {}, a1 = {};
    const float* k0 = krow[j];
    for (int64_t d = 0; d < D; ++d) {
      a0 += k0[d] * load16(qt + d * R);
      a1 += k0[d] * load16(qt + d * R + 16);
    }
    store16(st + j * R, a0);
    store16(st + j * R + 16, a1);
  }
}

// The rows path, for items with many query rows of one KV head (prefill chunks, prompt
// tails): rows row0 .. row0+rows-1 of sequence `seq`, KV head kh0, Q-tile row i = row * G + g,
// at most kMaxQRows. Q is transposed once (qt[d * kMaxQRows + i]), so the query rows sit in
// the SIMD lanes: each key row, read straight from the pool, is broadcast against them, and
// the online softmax runs across rows too.
template <int D_STATIC>
void attend_rows(const Args& a, const Item& it) {
  constexpr int R = kMaxQRows;
  const int64_t D = D_STATIC > 0 ? D_STATIC : a.head_dim;
  const int64_t G = a.group, H = a.kv_heads * G;
  const int64_t nq = it.rows * G;
  const Span sp = span_of(a, it);

  Scratch& sc = scratch();
  float* qt = sc.q.data();     // [D][R]
  float* acc = sc.acc.data();  // [R][D]
  float* kbuf = sc.kt.data();  // converted K rows of the tile [kKeyTile][D] (non-float32)
  float* vbuf = sc.vt.data();  // converted V rows [kKeyTile][D]
  float* st = sc.s.data();     // scores, then weights [kKeyTile][R]
  alignas(64) float m[R], l[R], lim[R], alpha[R];
  const float* krow[kKeyTile];
  const float* vrow[kKeyTile];

  std::fill(qt, qt + D * R, 0.0f);
  for (int64_t i = 0; i < R; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
    lim[i] = i < nq ? static_cast<float>(sp.first_pos + i / G + 1) : 0.0f;  // exact < 2^24
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t r = it.row0 + i / G, h = it.kh0 * G + i % G;
    for (int64_t d = 0; d < D; ++d)
      qt[d * R + i] = load_scalar(a.q, (r * H + h) * D + d, a.q_kind) * a.scale;
  }
  std::fill(acc, acc + R * D, 0.0f);

  for (int64_t t0 = 0; t0 < sp.n_keys; t0 += kKeyTile) {
    const int64_t nt = std::min<int64_t>(kKeyTile, sp.n_keys - t0);
    tile_rows(a, sp, t0, nt, it.kh0, 1, kbuf, vbuf, krow, vrow);
    scores_rows(qt, krow, nt, D, st);
    // Online softmax across the rows (two vectors of sixteen); key t0+j is visible to row i
    // iff t0+j < lim[i].
    const v16 lim0 = load16(lim), lim1 = load16(lim + 16);
    v16 mt0 = splat(-INFINITY), mt1 = splat(-INFINITY);
    for (int64_t j = 0; j < nt; ++j) {
      const float kpos = static_cast<float>(t0 + j);
      const v16 s0 = load16(st + j * R), s1 = load16(st + j * R + 16);
      mt0 = kpos < lim0 ? (s0 > mt0 ? s0 : mt0) : mt0;
      mt1 = kpos < lim1 ? (s1 > mt1 ? s1 : mt1) : mt1;
    }
    v16 m0 = load16(m), m1 = load16(m + 16);
    const v16 mn0 = mt0 > m0 ? mt0 : m0, mn1 = mt1 > m1 ? mt1 : m1;
    const v16 ms0 = mn0 == -INFINITY ? splat(0.0f) : mn0;
    const v16 ms1 = mn1 == -INFINITY ? splat(0.0f) : mn1;
    const v16 al0 = exp_nonpositive16(m0 - ms0), al1 = exp_nonpositive16(m1 - ms1);
    store16(alpha, al0);
    store16(alpha + 16, al1);
    store16(m, mn0);
    store16(m + 16, mn1);
    v16 l0 = load16(l) * al0, l1 = load16(l + 16) * al1;
    for (int64_t j = 0; j < nt; ++j) {
      const float kpos = static_cast<float>(t0 + j);
      const v16 p0 = kpos < lim0 ? exp_nonpositive16(load16(st + j * R) - ms0) : splat(0.0f);
      const v16 p1 = kpos < lim1 ? exp_nonpositive16(load16(st + j * R + 16) - ms1) : splat(0.0f);
      store16(st + j * R, p0);
      store16(st + j * R + 16, p1);
      l0 += p0;
      l1 += p1;
    }
    store16(l, l0);
    store16(l + 16, l1);
    // acc += P V, D in the SIMD lanes, two rows at a time (they share the V loads).
    int64_t i = 0;
    for (; i + 2 <= nq; i += 2) {
      if (kpos_visible_none(t0, lim[i + 1])) continue;  // rows see more keys as i grows
      pv_rows2<D_STATIC>(acc + i * D, acc + (i + 1) * D, alpha[i], alpha[i + 1], st + i, R,
                         vrow, nt, D);
    }
    if (i < nq && !kpos_visible_none(t0, lim[i]))
      pv_row<D_STATIC>(acc + i * D, alpha[i], st + i, R, vrow, 0, nt, D);
  }
  store_out(a, it, acc, l, nq);
}

template <int D_STATIC>
void attend_item(const Args& a, const Item& it) {
  if (it.keys) {
    attend_keys<D_STATIC>(a, it);
  } else {
    attend_rows<D_STATIC>(a, it);
  }
}

struct Work {
  Args args;
  std::vector<Item> items;
};

void run_item(const Work& w, int64_t i) {
  switch (w.args.head_dim) {
    case 64: attend_item<64>(w.args, w.items[i]); break;
    case 128: attend_item<128>(w.args, w.items[i]); break;
    default: attend_item<0>(w.args, w.items[i]);
  }
}

// Whether a pool array of this element type holds what `kind` says it does.
bool pool_type_ok(ffi::DataType t, int64_t kind) {
  switch (kind) {
    case 0: return t == ffi::DataType::F32;
    case 1: return t == ffi::DataType::BF16 || t == ffi::DataType::U16;
    case 2: return t == ffi::DataType::F16;
    case 3:
      return t == ffi::DataType::S8 || t == ffi::DataType::U8 ||
             t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
    default: return false;
  }
}

int64_t elem_kind(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 0;
    case ffi::DataType::BF16: return 1;
    case ffi::DataType::F16: return 2;
    default: return -1;
  }
}

ffi::Error RaggedImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::Buffer<ffi::U16> k_scale,
                      ffi::Buffer<ffi::U16> v_scale, ffi::Buffer<ffi::F32> lut,
                      ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq_lens,
                      ffi::Buffer<ffi::S32> qsl, ffi::Buffer<ffi::S32> num_seqs, int64_t layer,
                      int64_t kind, float scale, ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("cpu attention: q must be 3-D, the pool 5-D, tables 2-D");
  Args a{};
  a.q = q.untyped_data();
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.k_scale = k_scale.typed_data();
  a.v_scale = v_scale.typed_data();
  a.lut = lut.typed_data();
  a.tables = tables.typed_data();
  a.seq_lens = seq_lens.typed_data();
  a.qsl = qsl.typed_data();
  a.out = out->untyped_data();
  a.layer = layer;
  a.num_blocks = kd[1];
  a.block_size = kd[2];
  a.kv_heads = kd[3];
  a.head_dim = kd[4];
  a.table_cols = td[1];
  a.kind = kind;
  a.q_kind = elem_kind(q.element_type());
  a.scale = scale;
  const int64_t T = qd[0], H = qd[1], S = td[0];
  if (a.q_kind < 0 || elem_kind(out->element_type()) != a.q_kind)
    return ffi::Error::InvalidArgument("cpu attention: q and out must be float32/bfloat16/float16");
  if (H % a.kv_heads != 0 || qd[2] != a.head_dim || a.head_dim > kMaxHeadDim)
    return ffi::Error::InvalidArgument("cpu attention: q's heads or head_dim do not fit the pool");
  a.group = H / a.kv_heads;
  if (a.group > kMaxQRows || layer < 0 || layer >= kd[0] || seq_lens.element_count() < S ||
      qsl.element_count() < S + 1 || num_seqs.element_count() < 1)
    return ffi::Error::InvalidArgument("cpu attention: group, layer or metadata out of range");
  auto vd = v.dimensions();
  bool same = vd.size() == kd.size() && v.element_type() == k.element_type();
  for (size_t i = 0; same && i < kd.size(); ++i) same = vd[i] == kd[i];
  if (!same || !pool_type_ok(k.element_type(), kind))
    return ffi::Error::InvalidArgument("cpu attention: k and v pools differ, or their type is "
                                       "not the kind's");
  const int64_t scales = kd[0] * kd[1] * kd[2] * kd[3];
  if (kind == 3 && (k_scale.element_count() != scales || v_scale.element_count() != scales ||
                    lut.element_count() < 256))
    return ffi::Error::InvalidArgument("cpu attention: a one-byte pool needs [L, blocks, "
                                       "block_size, kv_heads] scales and a 256-entry table");

  Work work{};
  work.args = a;
  // Up to kMaxQRows query rows x query heads per item: a sequence's rows in runs of
  // kMaxQRows / G for one KV head each, or, for a sequence with fewer rows (a decode), all of
  // them with as many KV heads as fit (a block's rows of those heads are contiguous).
  const int64_t rows_per_item = std::max<int64_t>(1, kMaxQRows / a.group);
  const int64_t n_seqs = num_seqs.typed_data()[0];
  if (n_seqs < 0 || n_seqs > S || a.qsl[0] != 0)
    return ffi::Error::InvalidArgument("cpu attention: num_seqs out of range, or "
                                       "query_start_loc[0] is not 0");
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  int64_t real_rows = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t begin = a.qsl[s], end = a.qsl[s + 1];
    if (end < begin || end > T || a.seq_lens[s] < end - begin)
      return ffi::Error::InvalidArgument("cpu attention: inconsistent query_start_loc / seq_lens");
    real_rows = end;
    if (end == begin) continue;  // a sequence with no query rows this step
    const int64_t used = (a.seq_lens[s] + a.block_size - 1) / a.block_size;
    if (used > a.table_cols)
      return ffi::Error::InvalidArgument("cpu attention: a context is longer than its table");
    for (int64_t b = 0; b < used; ++b) {
      const int32_t id = a.tables[s * a.table_cols + b];
      if (id < 0 || id >= a.num_blocks)
        return ffi::Error::InvalidArgument("cpu attention: a block id is outside the pool");
    }
    const int64_t q_rows = end - begin;
    const int64_t heads = q_rows >= rows_per_item
                              ? 1
                              : std::clamp<int64_t>(kMaxQRows / (q_rows * a.group), 1, a.kv_heads);
    // Fewer sequences than threads (a single stream): one KV head per item, so every thread
    // reads its share of the keys. The path stays the one `heads` gives, whatever the batch,
    // so a sequence's result does not depend on its neighbours (the paths round differently).
    const int64_t nh = n_seqs < threads ? 1 : heads;
    for (int64_t r = begin; r < end; r += rows_per_item) {
      const int64_t rows = std::min(rows_per_item, end - r);
      const bool keys = !(heads == 1 && rows * a.group >= kRowsPathMin);
      for (int64_t kh = 0; kh < a.kv_heads; kh += nh)
        work.items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(r),
                              static_cast<int32_t>(rows), static_cast<int32_t>(kh),
                              static_cast<int32_t>(std::min(nh, a.kv_heads - kh)), keys});
    }
  }
  // Rows past the last real sequence are zeros.
  const int64_t elem = a.q_kind == 0 ? 4 : 2;
  std::memset(static_cast<char*>(a.out) + real_rows * H * a.head_dim * elem, 0,
              (T - real_rows) * H * a.head_dim * elem);
  jaxkv::RunShared(pool, static_cast<int64_t>(work.items.size()),
                   [&work](int64_t i) { run_item(work, i); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvRaggedPagedAttention, RaggedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k pool
                                  .Arg<ffi::AnyBuffer>()         // v pool
                                  .Arg<ffi::Buffer<ffi::U16>>()  // k_scale
                                  .Arg<ffi::Buffer<ffi::U16>>()  // v_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lut
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("kind")
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>());  // out
