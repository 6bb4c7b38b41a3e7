// jaxkv's few-row matmul for the CPU: an XLA FFI custom call (see cpu_linear.py).
//
// y_m = x @ W_m for one input x float32 [T, K] (T small: a decode step's rows) and one or
// more weights W_m float32, each [K, N_m] (a Flax kernel) or, with transposed = 1, [N_m, K]
// (an embedding table used as the LM head: y = x @ W^T). With so few rows the product is a
// read of the weights (a GEMV): XLA:CPU runs each such dot on one thread, ~14 GB/s on the
// 2-core machine, where both cores read ~28 GB/s. Here the weights' columns (or rows, when
// transposed) are cut into blocks, work items shared by the calling thread and tasks on
// XLA's intra-op thread pool through one atomic counter (as cpu_attention.cc), so every core
// streams its own part of the weights from memory once (a block is read again from cache for
// each further group of 4 rows of x, 2 in the transposed layout); several weights of one
// input (q/k/v, gate/up) go in one call, one set of items.
//
// Every output element is one thread's sum in a fixed order (over k in increasing order with
// fused multiply-adds; in the transposed layout 16 lane sums over k, then added pairwise),
// so the result does not depend on the thread count, the timing or the other rows of x.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Sixteen float32 lanes (one AVX-512 register, two AVX2 ones), naturally aligned so GCC keeps
// the accumulators in registers (an under-aligned vector type made it spill them to the
// stack: 8 GB/s instead of 12-13 from one core); unaligned memory goes through memcpy.
typedef float v16 __attribute__((vector_size(64)));

constexpr int64_t kMaxRows = 16;     // rows of x per call
constexpr int64_t kMaxWeights = 8;   // weights per call
constexpr int64_t kBlockCols = 64;   // columns of a [K, N] weight per item
constexpr int64_t kBlockRows = 32;   // rows of a [N, K] weight per item
constexpr int64_t kPrefetchRows = 8; // how far ahead an item prefetches its weight rows

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

struct Item {
  int32_t m;   // which weight
  int32_t n0;  // first column ([K, N]) or row ([N, K]) of the block
  int32_t len; // columns or rows in the block
};

struct Work {
  const float* x = nullptr;
  int64_t rows = 0, k = 0;
  bool transposed = false;
  Weight weights[kMaxWeights];
  std::vector<Item> items;
  std::atomic<int64_t> next{0}, done{0};
};

// Columns [c0, c0 + 16 * NV) of y[r0 .. r0 + R) for a [K, N] weight: the accumulators stay in
// registers over all K rows; the weight rows are read once, for all R rows of x.
template <int R, int NV>
void cols_block(const float* x, int64_t ldx, const float* w, int64_t K, int64_t N, int64_t c0,
                float* y) {
  v16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = v16{};
  const float* wp = w + c0;
  for (int64_t kk = 0; kk < K; ++kk, wp += N) {
    if (kk + kPrefetchRows < K)
      for (int j = 0; j < NV; ++j) __builtin_prefetch(wp + kPrefetchRows * N + 16 * j, 0, 3);
    v16 wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = load16(wp + 16 * j);
    for (int r = 0; r < R; ++r) {
      const v16 xv = splat(x[r * ldx + kk]);
      for (int j = 0; j < NV; ++j) acc[r][j] += xv * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) store16(y + r * N + c0 + 16 * j, acc[r][j]);
}

// One column block of every row of x (in row groups of up to 4), any width: 16-lane groups,
// then the columns left over one at a time.
template <int NV>
void cols_rows(const Work& w, const Weight& m, int64_t c0, int64_t len) {
  const int64_t K = w.k, N = m.n;
  for (int64_t r0 = 0; r0 < w.rows; r0 += 4) {
    const float* x = w.x + r0 * K;
    float* y = m.y + r0 * N;
    const int64_t R = std::min<int64_t>(4, w.rows - r0);
    int64_t c = c0;
    const int64_t vec_end = c0 + (len / 16) * 16;
    for (; c + 16 * NV <= vec_end; c += 16 * NV) {
      switch (R) {
        case 1: cols_block<1, NV>(x, K, m.w, K, N, c, y); break;
        case 2: cols_block<2, NV>(x, K, m.w, K, N, c, y); break;
        case 3: cols_block<3, NV>(x, K, m.w, K, N, c, y); break;
        default: cols_block<4, NV>(x, K, m.w, K, N, c, y);
      }
    }
    for (; c + 16 <= vec_end; c += 16) {
      switch (R) {
        case 1: cols_block<1, 1>(x, K, m.w, K, N, c, y); break;
        case 2: cols_block<2, 1>(x, K, m.w, K, N, c, y); break;
        case 3: cols_block<3, 1>(x, K, m.w, K, N, c, y); break;
        default: cols_block<4, 1>(x, K, m.w, K, N, c, y);
      }
    }
    for (; c < c0 + len; ++c)
      for (int64_t r = 0; r < R; ++r) {
        float s = 0.0f;
        for (int64_t kk = 0; kk < K; ++kk) s += x[r * K + kk] * m.w[kk * N + c];
        y[r * N + c] = s;
      }
  }
}

// y[r, n0 + i] = dot(x[r], W[n0 + i]) for i < NR (4 weight rows at once) and r < R: each
// weight row is read once for the R rows of x, each chunk of x once for the NR weight rows.
template <int R, int NR>
void dots_block(const float* x, int64_t K, const float* w, int64_t n0, float* y, int64_t ldy) {
  const int64_t kv = (K / 16) * 16;
  v16 acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) acc[r][i] = v16{};
  const float* wr = w + n0 * K;
  for (int i = 0; i < NR; ++i) __builtin_prefetch(wr + (NR + i) * K, 0, 3);
  for (int64_t kk = 0; kk < kv; kk += 16) {
    v16 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = load16(wr + i * K + kk);
    for (int r = 0; r < R; ++r) {
      const v16 xv = load16(x + r * K + kk);
      for (int i = 0; i < NR; ++i) acc[r][i] += xv * wv[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NR; ++i) {
      float s = hsum(acc[r][i]);
      for (int64_t kk = kv; kk < K; ++kk) s += x[r * K + kk] * wr[i * K + kk];
      y[r * ldy + n0 + i] = s;
    }
}

// Rows [n0, n0 + len) of a [N, K] weight, for every row of x (in pairs).
void rows_block(const Work& w, const Weight& m, int64_t n0, int64_t len) {
  const int64_t K = w.k;
  for (int64_t r0 = 0; r0 < w.rows; r0 += 2) {
    const float* x = w.x + r0 * K;
    float* y = m.y + r0 * m.n;
    const bool two = r0 + 1 < w.rows;
    int64_t n = n0;
    for (; n + 4 <= n0 + len; n += 4)
      two ? dots_block<2, 4>(x, K, m.w, n, y, m.n) : dots_block<1, 4>(x, K, m.w, n, y, m.n);
    for (; n < n0 + len; ++n)
      two ? dots_block<2, 1>(x, K, m.w, n, y, m.n) : dots_block<1, 1>(x, K, m.w, n, y, m.n);
  }
}

void run_items(Work& w) {
  const int64_t total = static_cast<int64_t>(w.items.size());
  int64_t finished = 0;
  for (int64_t i; (i = w.next.fetch_add(1, std::memory_order_relaxed)) < total; ++finished) {
    const Item& it = w.items[i];
    const Weight& m = w.weights[it.m];
    if (w.transposed)
      rows_block(w, m, it.n0, it.len);
    else
      cols_rows<4>(w, m, it.n0, it.len);
  }
  if (finished) w.done.fetch_add(finished, std::memory_order_acq_rel);
}

ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                      int64_t transposed, ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] > kMaxRows)
    return ffi::Error::InvalidArgument("cpu linear: x must be [T, K] with T <= 16");
  const int64_t n_w = static_cast<int64_t>(ws.size());
  if (n_w < 1 || n_w > kMaxWeights || ys.size() != ws.size())
    return ffi::Error::InvalidArgument("cpu linear: 1-8 weights, one output each");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->rows = xd[0];
  work->k = xd[1];
  work->transposed = transposed != 0;
  const int64_t block = work->transposed ? kBlockRows : kBlockCols;
  for (int64_t m = 0; m < n_w; ++m) {
    auto wm = ws.get<ffi::Buffer<ffi::F32>>(m);
    auto ym = ys.get<ffi::Buffer<ffi::F32>>(m);
    if (!wm.has_value() || !ym.has_value())
      return ffi::Error::InvalidArgument("cpu linear: weights and outputs must be float32");
    auto wd = wm->dimensions();
    auto yd = (*ym)->dimensions();
    if (wd.size() != 2 || yd.size() != 2) return ffi::Error::InvalidArgument("cpu linear: 2-D only");
    const int64_t k = work->transposed ? wd[1] : wd[0], n = work->transposed ? wd[0] : wd[1];
    if (k != work->k || yd[0] != work->rows || yd[1] != n)
      return ffi::Error::InvalidArgument("cpu linear: weight " + std::to_string(m) + " [" +
                                         std::to_string(wd[0]) + ", " + std::to_string(wd[1]) +
                                         "] or its output does not fit x [" +
                                         std::to_string(work->rows) + ", " +
                                         std::to_string(work->k) + "]");
    if (n >= (int64_t{1} << 31))
      return ffi::Error::InvalidArgument("cpu linear: a weight has 2^31 or more outputs");
    work->weights[m] = {wm->typed_data(), (*ym)->typed_data(), n};
    for (int64_t n0 = 0; n0 < n; n0 += block)
      work->items.push_back({static_cast<int32_t>(m), static_cast<int32_t>(n0),
                             static_cast<int32_t>(std::min(block, n - n0))});
  }
  const int64_t total = static_cast<int64_t>(work->items.size());
  if (work->rows == 0 || work->k == 0) {  // nothing to read: zeros
    for (int64_t m = 0; m < n_w; ++m)
      std::memset(work->weights[m].y, 0, work->rows * work->weights[m].n * sizeof(float));
    return ffi::Error::Success();
  }
  const int64_t helpers =
      std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1) - 1, total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { run_items(*work); });
  run_items(*work);
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
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
