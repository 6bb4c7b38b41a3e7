// jaxkv's few-row matmul for the CPU: an XLA FFI custom call (see linear.py).
//
// y_m = x @ W_m for one input x float32 [T, K] (T small: a decode step's rows) and one or
// more weights W_m float32, each [K, N_m] (a Flax kernel) or, with transposed = 1, [N_m, K]
// (an embedding table used as the LM head: y = x @ W^T). With so few rows the product is a
// read of the weights (a GEMV): XLA:CPU runs each such dot on one thread, ~14 GB/s on the
// 2-core machine, where both cores read ~28 GB/s. Here the weights are cut into work items
// shared by the calling thread and tasks on XLA's intra-op thread pool through one atomic
// counter (work_sharing.h), so every core streams its own part of the weights from
// memory once; several weights of one input (q/k/v, gate/up) go in one call, one set of items.
//
// The items follow the memory: a [K, N] weight's item is a chunk of kChunkRows consecutive
// rows (of a group of at most kGroupCols columns), one contiguous block that the hardware
// prefetchers stream (items of 64 columns over all K rows, 256 bytes per row and a new page
// every row, read at ~19 GB/s on the 2-core Xeon; chunks at ~24); its partial sums go to a
// scratch buffer, and the thread that finishes a group's last chunk adds them, in chunk
// order, into y. A [N, K] weight's item is a block of kBlockRows rows, already contiguous.
// One core reading one stream keeps too few lines in flight (~12 GB/s; 4 streams side by
// side ~15, the 2 cores ~30 against ~24), so with 1 to 4 rows of x an item holds several
// whole chunks read side by side, and a block's quarters are read side by side.
//
// Every output element is a sum in a fixed order (over each chunk's k in increasing order
// with fused multiply-adds, then the chunks in order; in the transposed layout 16 lane sums
// over k, then added pairwise), so the result does not depend on the thread count, the
// timing or the other rows of x.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Sixteen float32 lanes (one AVX-512 register, two AVX2 ones), naturally aligned so GCC keeps
// the accumulators in registers (an under-aligned vector type made it spill them to the
// stack: 8 GB/s instead of 12-13 from one core); unaligned memory goes through memcpy.
typedef float v16 __attribute__((vector_size(64)));

constexpr int64_t kMaxRows = 16;     // rows of x per call
constexpr int64_t kMaxWeights = 8;   // weights per call
constexpr int64_t kGroupCols = 2048; // columns of a [K, N] weight per group of items
constexpr int64_t kChunkRows = 64;   // rows of a [K, N] weight per item (a chunk of K)
constexpr int64_t kPrefetchRows = 8; // how far ahead a chunk prefetches its weight rows
constexpr int64_t kBlockRows = 256;  // rows of a [N, K] weight per item

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 splat(float x) { return v16{} + x; }
inline float hsum(v16 v) {  // a fixed pairwise order
  float h[16];
  store16(h, v);
  for (int w = 8; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) h[i] += h[i + w];
  return h[0];
}

struct Weight {
  const float* w;
  float* y;
  int64_t n;
};

// A [K, N] weight's columns are cut into groups of at most kGroupCols, and its rows into chunks
// of kChunkRows: an item is one (group, chunk), whose partial sums go to the group's part of
// the call's buffer; the thread that finishes a group's last chunk adds its chunks' partial
// sums, in chunk order, into y. A [N, K] (transposed) weight's items are blocks of kBlockRows
// rows, each computed whole.
struct Group {
  int32_t m = 0;           // which weight
  int32_t n0 = 0, len = 0; // its columns
  int32_t chunks = 0;      // chunks of K (an item holds one, or several whole ones)
  float* part = nullptr;   // [chunks, rows, len] partial sums
  std::atomic<int32_t> left{0};
};

struct Item {
  int32_t m;    // which weight
  int32_t n0;   // first row of the block ([N, K]); unused for [K, N]
  int32_t len;  // rows in the block ([N, K]); unused for [K, N]
  int32_t g;    // the group ([K, N]); -1 for [N, K]
  int32_t k0;   // first row of the chunk ([K, N])
  int32_t nch;  // chunks from k0 ([K, N]; 1, or several whole ones read side by side)
};

struct Work {
  const float* x = nullptr;
  int64_t rows = 0, k = 0;
  bool transposed = false;
  Weight weights[kMaxWeights];
  std::vector<Item> items;
  std::unique_ptr<Group[]> groups;
};

// Partial sums of S chunks of a [K, N] weight, each of klen rows (klen = kChunkRows when S > 1;
// chunk c's rows right after chunk c - 1's): p[c * pstride + r * len + col] = the sum over
// chunk c's rows k, in increasing order, of x[r, k] * w[k, col] for col < len, r < R. A
// chunk's rows are read one after the other, each a contiguous run of len columns (the whole
// chunk is one contiguous block when len = N), four at a time; the partial sums stay in p
// (L1). With S > 1 one core reads S streams side by side, which keeps more lines in flight
// (a core summing 4 streams reads ~15 GB/s on the 2-core Xeon, one stream ~12); each chunk's
// sums are the same, in the same order, as when it is read alone.
template <int R, int S>
void chunks_rows(const float* x, int64_t ldx, const float* w, int64_t N, int64_t klen,
                 int64_t len, float* p, int64_t pstride) {
  const int64_t nv = len / 16, vend = nv * 16, cstride = klen * N;
  for (int c = 0; c < S; ++c)
    for (int r = 0; r < R; ++r) std::memset(p + c * pstride + r * len, 0, len * sizeof(float));
  int64_t kk = 0;
  for (; kk + 4 <= klen; kk += 4, w += 4 * N) {
    v16 xv[S][R][4];
    for (int c = 0; c < S; ++c)
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 4; ++i) xv[c][r][i] = splat(x[r * ldx + c * klen + kk + i]);
    const bool prefetch = kk + kPrefetchRows + 4 <= klen;
    for (int64_t j = 0; j < nv; ++j)
      for (int c = 0; c < S; ++c) {
        const float* wc = w + c * cstride + 16 * j;
        if (prefetch)  // into L2, two groups of 4 rows ahead (+15% at 4 rows of x)
          for (int i = 0; i < 4; ++i) __builtin_prefetch(wc + (kPrefetchRows + i) * N, 0, 2);
        const v16 w0 = load16(wc), w1 = load16(wc + N), w2 = load16(wc + 2 * N),
                  w3 = load16(wc + 3 * N);
        for (int r = 0; r < R; ++r) {
          float* pc = p + c * pstride + r * len + 16 * j;
          v16 a = load16(pc);
          a += xv[c][r][0] * w0;
          a += xv[c][r][1] * w1;
          a += xv[c][r][2] * w2;
          a += xv[c][r][3] * w3;
          store16(pc, a);
        }
      }
    for (int64_t col = vend; col < len; ++col)
      for (int c = 0; c < S; ++c)
        for (int r = 0; r < R; ++r) {
          float* pc = p + c * pstride + r * len + col;
          float a = *pc;
          for (int i = 0; i < 4; ++i)
            a += x[r * ldx + c * klen + kk + i] * w[c * cstride + i * N + col];
          *pc = a;
        }
  }
  for (; kk < klen; ++kk, w += N)  // a short chunk's last rows (S = 1 only: whole chunks
    for (int c = 0; c < S; ++c)     // have a multiple of 4)
      for (int r = 0; r < R; ++r) {
        const float xs = x[r * ldx + c * klen + kk];
        const v16 xc = splat(xs);
        float* pc = p + c * pstride + r * len;
        const float* wc = w + c * cstride;
        for (int64_t j = 0; j < nv; ++j) store16(pc + 16 * j, load16(pc + 16 * j) + xc * load16(wc + 16 * j));
        for (int64_t col = vend; col < len; ++col) pc[col] += xs * wc[col];
      }
}

// y[r, n0 + i * gap] = dot(x[r], W[n0 + i * gap]) for i < NR and r < R: each weight row is
// read once for the R rows of x, each chunk of x once for the NR weight rows. The NR rows are
// gap rows apart, so that one core reads NR streams at once: the hardware prefetchers keep
// more lines in flight for several streams than for one (a core summing 4 streams reads
// ~15 GB/s on the 2-core Xeon, one stream ~12).
template <int R, int NR>
void dots_block(const float* x, int64_t K, const float* w, int64_t n0, int64_t gap, float* y,
                int64_t ldy) {
  const int64_t kv = (K / 16) * 16;
  v16 acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) acc[r][i] = v16{};
  const float* wr = w + n0 * K;
  for (int64_t kk = 0; kk < kv; kk += 16) {
    v16 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = load16(wr + i * gap * K + kk);
    for (int r = 0; r < R; ++r) {
      const v16 xv = load16(x + r * K + kk);
      for (int i = 0; i < NR; ++i) acc[r][i] += xv * wv[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) {
      float s = hsum(acc[r][i]);
      for (int64_t kk = kv; kk < K; ++kk) s += x[r * K + kk] * wr[i * gap * K + kk];
      y[r * ldy + n0 + i * gap] = s;
    }
}

// Rows [n0, n0 + len) of a [N, K] weight, for every row of x (in pairs): the block's quarters
// side by side (row n of each quarter at once, four streams), the rows past them one by one.
void rows_block(const Work& w, const Weight& m, int64_t n0, int64_t len) {
  const int64_t K = w.k, q = len / 4;
  for (int64_t r0 = 0; r0 < w.rows; r0 += 2) {
    const float* x = w.x + r0 * K;
    float* y = m.y + r0 * m.n;
    const bool two = r0 + 1 < w.rows;
    for (int64_t n = n0; n < n0 + q; ++n)
      two ? dots_block<2, 4>(x, K, m.w, n, q, y, m.n) : dots_block<1, 4>(x, K, m.w, n, q, y, m.n);
    for (int64_t n = n0 + 4 * q; n < n0 + len; ++n)
      two ? dots_block<2, 1>(x, K, m.w, n, 0, y, m.n) : dots_block<1, 1>(x, K, m.w, n, 0, y, m.n);
  }
}

// chunks_rows for a group of R (1-4) rows of x.
template <int S>
void chunks_row_group(int64_t R, const float* x, int64_t ldx, const float* w, int64_t N,
                      int64_t klen, int64_t len, float* p, int64_t pstride) {
  switch (R) {
    case 1: return chunks_rows<1, S>(x, ldx, w, N, klen, len, p, pstride);
    case 2: return chunks_rows<2, S>(x, ldx, w, N, klen, len, p, pstride);
    case 3: return chunks_rows<3, S>(x, ldx, w, N, klen, len, p, pstride);
    default: return chunks_rows<4, S>(x, ldx, w, N, klen, len, p, pstride);
  }
}

// Chunks k0 .. of a [K, N] weight's group (nch of them: several only when they are whole and
// x has at most 4 rows, see streams()): their partial sums, in row groups of up to 4 rows.
void chunk_item(const Work& w, const Group& g, int64_t k0, int64_t nch) {
  const Weight& m = w.weights[g.m];
  const int64_t K = w.k, klen = std::min(kChunkRows, K - k0);
  float* part = g.part + (k0 / kChunkRows) * w.rows * g.len;
  const float* wk = m.w + k0 * m.n + g.n0;
  const int64_t pstride = w.rows * g.len;
  if (nch == 4) return chunks_rows<1, 4>(w.x + k0, K, wk, m.n, klen, g.len, part, pstride);
  for (int64_t r0 = 0; r0 < w.rows; r0 += 4) {
    const float* x = w.x + r0 * K + k0;
    float* p = part + r0 * g.len;
    const int64_t R = std::min<int64_t>(4, w.rows - r0);
    if (nch == 2) chunks_row_group<2>(R, x, K, wk, m.n, klen, g.len, p, pstride);
    else chunks_row_group<1>(R, x, K, wk, m.n, klen, g.len, p, pstride);
  }
}

// Chunks per item for x of `rows` rows: 4 streams per core for one row, 2 for 2-4 rows (in
// the 30 layers of SmolLM2: 3-4 rows 3-5% faster than one stream; 5-16 rows no faster).
int64_t streams(int64_t rows) { return rows == 1 ? 4 : rows <= 4 ? 2 : 1; }

// y[r, n0 + c] = the group's partial sums added in chunk order (the group's last chunk done).
void reduce_group(const Work& w, const Group& g) {
  const Weight& m = w.weights[g.m];
  const int64_t len = g.len, vend = (len / 16) * 16, stride = w.rows * len;
  for (int64_t r = 0; r < w.rows; ++r) {
    const float* p = g.part + r * len;
    float* y = m.y + r * m.n + g.n0;
    for (int64_t c = 0; c < vend; c += 16) {
      v16 a = load16(p + c);
      for (int32_t ch = 1; ch < g.chunks; ++ch) a += load16(p + ch * stride + c);
      store16(y + c, a);
    }
    for (int64_t c = vend; c < len; ++c) {
      float a = p[c];
      for (int32_t ch = 1; ch < g.chunks; ++ch) a += p[ch * stride + c];
      y[c] = a;
    }
  }
}

void run_item(const Work& w, int64_t i) {
  const Item& it = w.items[i];
  if (w.transposed) {
    rows_block(w, w.weights[it.m], it.n0, it.len);
  } else {
    Group& g = w.groups[it.g];
    chunk_item(w, g, it.k0, it.nch);
    if (g.left.fetch_sub(it.nch, std::memory_order_acq_rel) == it.nch) reduce_group(w, g);
  }
}

ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                      int64_t transposed, ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] > kMaxRows)
    return ffi::Error::InvalidArgument("cpu linear: x must be [T, K] with T <= 16");
  const int64_t n_w = static_cast<int64_t>(ws.size());
  if (n_w < 1 || n_w > kMaxWeights || ys.size() != ws.size())
    return ffi::Error::InvalidArgument("cpu linear: 1-8 weights, one output each");
  Work work{};
  work.x = x.typed_data();
  work.rows = xd[0];
  work.k = xd[1];
  work.transposed = transposed != 0;
  for (int64_t m = 0; m < n_w; ++m) {
    auto wm = ws.get<ffi::Buffer<ffi::F32>>(m);
    auto ym = ys.get<ffi::Buffer<ffi::F32>>(m);
    if (!wm.has_value() || !ym.has_value())
      return ffi::Error::InvalidArgument("cpu linear: weights and outputs must be float32");
    auto wd = wm->dimensions();
    auto yd = (*ym)->dimensions();
    if (wd.size() != 2 || yd.size() != 2) return ffi::Error::InvalidArgument("cpu linear: 2-D only");
    const int64_t k = work.transposed ? wd[1] : wd[0], n = work.transposed ? wd[0] : wd[1];
    if (k != work.k || yd[0] != work.rows || yd[1] != n)
      return ffi::Error::InvalidArgument("cpu linear: weight " + std::to_string(m) + " [" +
                                         std::to_string(wd[0]) + ", " + std::to_string(wd[1]) +
                                         "] or its output does not fit x [" +
                                         std::to_string(work.rows) + ", " +
                                         std::to_string(work.k) + "]");
    if (n >= (int64_t{1} << 31))
      return ffi::Error::InvalidArgument("cpu linear: a weight has 2^31 or more outputs");
    work.weights[m] = {wm->typed_data(), (*ym)->typed_data(), n};
  }
  if (work.rows == 0 || work.k == 0) {  // nothing to read: zeros
    for (int64_t m = 0; m < n_w; ++m)
      std::memset(work.weights[m].y, 0, work.rows * work.weights[m].n * sizeof(float));
    return ffi::Error::Success();
  }
  if (work.transposed) {
    for (int64_t m = 0; m < n_w; ++m)
      for (int64_t n0 = 0; n0 < work.weights[m].n; n0 += kBlockRows)
        work.items.push_back({static_cast<int32_t>(m), static_cast<int32_t>(n0),
                              static_cast<int32_t>(std::min(kBlockRows, work.weights[m].n - n0)),
                              -1, 0, 0});
  } else {
    // Column groups of near-equal width (a multiple of 16 where the weight allows), each cut
    // into chunks of K; their partial sums in this thread's scratch buffer.
    thread_local std::vector<float> scratch;
    const int64_t chunks = (work.k + kChunkRows - 1) / kChunkRows;
    int64_t n_groups = 0, floats = 0;
    int64_t group_n[kMaxWeights];
    for (int64_t m = 0; m < n_w; ++m) {
      group_n[m] = (work.weights[m].n + kGroupCols - 1) / kGroupCols;
      n_groups += group_n[m];
      floats += chunks * work.rows * work.weights[m].n;
    }
    if (static_cast<int64_t>(scratch.size()) < floats) scratch.resize(floats);
    work.groups.reset(new Group[n_groups]);
    float* part = scratch.data();
    int64_t gi = 0;
    for (int64_t m = 0; m < n_w; ++m) {
      const int64_t n = work.weights[m].n;
      if (n == 0) continue;  // nothing to compute (and no group to divide among)
      const int64_t width = ((n + group_n[m] - 1) / group_n[m] + 15) / 16 * 16;
      for (int64_t n0 = 0; n0 < n; n0 += width, ++gi) {
        Group& g = work.groups[gi];
        g.m = static_cast<int32_t>(m);
        g.n0 = static_cast<int32_t>(n0);
        g.len = static_cast<int32_t>(std::min(width, n - n0));
        g.chunks = static_cast<int32_t>(chunks);
        g.part = part;
        g.left.store(static_cast<int32_t>(chunks), std::memory_order_relaxed);
        part += chunks * work.rows * g.len;
        // Whole chunks in items of streams(rows) (the last ones, and a short last chunk,
        // alone).
        const int64_t per = streams(work.rows), whole = work.k / kChunkRows;
        for (int64_t c = 0; c < chunks;) {
          const int64_t nch = c + per <= whole ? per : 1;
          work.items.push_back({static_cast<int32_t>(m), 0, 0, static_cast<int32_t>(gi),
                                static_cast<int32_t>(c * kChunkRows), static_cast<int32_t>(nch)});
          c += nch;
        }
      }
    }
  }
  jaxkv::RunShared(pool, static_cast<int64_t>(work.items.size()),
                   [&work](int64_t i) { run_item(work, i); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvLinear, LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .RemainingArgs()               // weights
                                  .Attr<int64_t>("transposed")
                                  .RemainingRets());             // outputs
