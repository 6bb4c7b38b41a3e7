// jaxkv's matmul of a few dozen rows for the CPU: an XLA FFI custom call (see linear.py).
//
// y_m = x @ W_m for one input x float32 [T, K] (17 <= T <= 128: a decode step of 17 to 64
// sequences, or a step of up to 128 tokens) and one to eight weights W_m float32 [K, N_m] (Flax kernels). XLA:CPU's dots
// reach ~190-200 GFLOP/s at 64 rows on the 2-core Xeon (its 8-product GEMM probe 229-266).
// Here a register-blocked kernel (kRows rows x kVecs vectors of sums in registers) computes
// strips of kStrip columns, kKBlock rows of W at a time: the block stays in L1 while every
// group of kRows rows of x passes over it, and the next block is prefetched, a few lines per
// k, during those passes, so the weights stream from memory about as fast as the FMAs use
// them (without the prefetch the first pass waits on each row of the block, a new page every
// row). The columns of all the call's weights are cut into equal contiguous shares, one per
// thread (the calling thread and tasks on XLA's intra-op pool). Measured on the 2-core Xeon:
// a 64-sequence decode step of SmolLM2 112 -> 101.5 ms, its 30 layers' matmuls 64.3 -> 60
// ms (benchmarks/profile_step.py, side by side); the same kernel outside XLA, 30 layers
// chained, 51-57 ms (265 GFLOP/s) and 40 ms with the weights in cache. In XLA programs of
// the 30 layers' matmuls (benchmarks' chain, side by side): 32 rows 47.9 ms against XLA's
// 60.9, 64 rows 64.9 against 68.0, 128 rows 104.5 against 114.9 (256 rows: 183.7 against
// 190.1, left to XLA).
//
// Every output element is x[r] . W[:, n] summed over k in increasing order with fused
// multiply-adds from zero (y holds the running sum between blocks), so the result does not
// depend on the thread count, the timing or the other rows of x.

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "work_sharing.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));  // 16 lanes, 32 registers
constexpr int kRows = 8;
#else
typedef float vec __attribute__((vector_size(32)));  // 8 lanes (AVX2: 16 registers)
constexpr int kRows = 4;
#endif
constexpr int kLanes = sizeof(vec) / sizeof(float);
constexpr int kVecs = 3;                       // accumulators per row (run_block)
constexpr int64_t kStrip = kVecs * kLanes;     // columns per strip
constexpr int64_t kKBlock = 192;               // rows of W per block
constexpr int64_t kMinRows = 17, kMaxRows = 128;
constexpr int64_t kMaxWeights = 8;

inline vec loadv(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
// x in every lane: one broadcast from memory (vec{} + x would add in the FMA ports first).
inline vec broadcast(const float* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_set1_ps(*p);
#elif defined(__AVX__)
  return (vec)_mm256_set1_ps(*p);
#else
  return vec{} + *p;
#endif
}

// c + a * b rounded once (a fused multiply-add), lane by lane: the FMA instructions where the
// build has them (AVX-512, or AVX2 with FMA3), else std::fma per lane (the same bits; slow on
// a CPU without FMA hardware, which jaxkv's -march=native build then emulates).
inline vec fmadd(vec a, vec b, vec c) {
#if defined(__AVX512F__)
  return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX__) && defined(__FMA__)
  return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  for (int i = 0; i < kLanes; ++i) c[i] = std::fma(a[i], b[i], c[i]);
  return c;
#endif
}

// One block of work: columns [n0, n0 + width) of weight w (ld n), rows [k0, k0 + klen).
struct Block {
  const float* w;
  float* y;
  int64_t n, n0, width, k0, klen;
};

// A walk over the cache lines of a block (row by row, left to right), prefetching them into L1.
struct LineWalk {
  const float* row;   // the current row's first column
  int64_t ld, line, per_row;

  LineWalk(const Block& b, int64_t first)
      : row(b.w + b.k0 * b.n + b.n0), ld(b.n), line(first), per_row((b.width * 4 + 63) / 64) {
    row += (first / per_row) * ld;
    line = first % per_row;
  }
  void prefetch() {
    __builtin_prefetch(row + line * 16, 0, 3);
    if (++line == per_row) line = 0, row += ld;
  }
};

// R rows of x (from row r0) over the first NV vectors of columns of block b:
// y = (k0 ? y : 0) + the block's sum. While it runs, lines [pf0, pf1) of the next
// block are prefetched, spread over the k loop.
template <int R, int NV>
void block_rows(const float* x, int64_t K, const Block& b, int64_t r0, const Block* next,
                int64_t pf0, int64_t pf1) {
  vec acc[R][NV];
  float* y = b.y + r0 * b.n + b.n0;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = b.k0 ? loadv(y + r * b.n + v * kLanes) : vec{};
  const float* xr = x + r0 * K + b.k0;
  const float* w = b.w + b.k0 * b.n + b.n0;
  // Lines of the next block per k: one, or two when they outnumber this pass's k.
  const int64_t lines = next ? pf1 - pf0 : 0, twice = lines > b.klen ? lines - b.klen : 0;
  LineWalk walk = next ? LineWalk(*next, pf0) : LineWalk(b, 0);
  for (int64_t k = 0; k < b.klen; ++k, w += b.n) {
    if (k < lines) walk.prefetch();
    if (k < twice) walk.prefetch();
    vec wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = loadv(w + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const vec a = broadcast(xr + r * K + k);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(a, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) storev(y + r * b.n + v * kLanes, acc[r][v]);
}

// The rows of x from r0 (fewer than kRows) over NV vectors of columns.
template <int R, int NV>
void tail_rows(const float* x, int64_t K, const Block& b, int64_t r0, int64_t left) {
  if constexpr (R > 1) {
    if (left < R) return tail_rows<R - 1, NV>(x, K, b, r0, left);
  }
  block_rows<R, NV>(x, K, b, r0, nullptr, 0, 0);
}

// Every row of x over NV vectors of columns, prefetching `lines` lines of the next block
// over the full passes.
template <int NV>
void rows_over(const float* x, int64_t K, int64_t rows, const Block& b, const Block* next,
               int64_t lines) {
  const int64_t passes = rows / kRows;
  for (int64_t p = 0; p < passes; ++p)
    block_rows<kRows, NV>(x, K, b, p * kRows, next, lines * p / passes,
                          lines * (p + 1) / passes);
  if (rows % kRows) tail_rows<kRows - 1, NV>(x, K, b, passes * kRows, rows % kRows);
}

// Every row of x over block b, prefetching the next block during the passes. A narrower
// block (a weight's last columns) goes by fewer vectors, its last columns (fewer than
// kLanes) element by element in the same order.
void run_block(const float* x, int64_t K, int64_t rows, const Block& b, const Block* next) {
  const int64_t lines = next ? next->klen * ((next->width * 4 + 63) / 64) : 0;
  const int64_t nv = b.width / kLanes;
  if (nv == 3) rows_over<3>(x, K, rows, b, next, lines);
  else if (nv == 2) rows_over<2>(x, K, rows, b, next, lines);
  else if (nv == 1) rows_over<1>(x, K, rows, b, next, lines);
  for (int64_t c = nv * kLanes; c < b.width; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      float* y = b.y + r * b.n + b.n0 + c;
      float a = b.k0 ? *y : 0.0f;
      for (int64_t k = 0; k < b.klen; ++k)
        a = std::fma(x[r * K + b.k0 + k], b.w[(b.k0 + k) * b.n + b.n0 + c], a);
      *y = a;
    }
}

struct Work {
  const float* x = nullptr;
  int64_t rows = 0, k = 0;
  int64_t n_w = 0;
  const float* w[kMaxWeights];
  float* y[kMaxWeights];
  int64_t n[kMaxWeights];
  int64_t strips = 0, shares = 1;
};

// Share s of the strips (all weights' strips in order, kStrip columns each, a weight's last
// one possibly narrower): its blocks in order (per weight: K-block by K-block, each over the
// share's strips), each prefetching the next.
void run_share(const Work& w, int64_t s) {
  const int64_t first = w.strips * s / w.shares, last = w.strips * (s + 1) / w.shares;
  thread_local std::vector<Block> blocks;  // kept for the thread's next call
  blocks.clear();
  int64_t base = 0;
  for (int64_t m = 0; m < w.n_w; ++m) {
    const int64_t count = (w.n[m] + kStrip - 1) / kStrip;
    const int64_t lo = std::max(first, base), hi = std::min(last, base + count);
    for (int64_t k0 = 0; lo < hi && k0 < w.k; k0 += kKBlock)
      for (int64_t i = lo - base; i < hi - base; ++i) {
        const int64_t n0 = i * kStrip;
        blocks.push_back({w.w[m], w.y[m], w.n[m], n0, std::min(kStrip, w.n[m] - n0), k0,
                          std::min(kKBlock, w.k - k0)});
      }
    base += count;
  }
  for (size_t i = 0; i < blocks.size(); ++i)
    run_block(w.x, w.k, w.rows, blocks[i], i + 1 < blocks.size() ? &blocks[i + 1] : nullptr);
}

ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                    ffi::RemainingRets ys) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] < kMinRows || xd[0] > kMaxRows)
    return ffi::Error::InvalidArgument("cpu gemm: x must be [T, K] with 17 <= T <= 128");
  const int64_t n_w = static_cast<int64_t>(ws.size());
  if (n_w < 1 || n_w > kMaxWeights || ys.size() != ws.size())
    return ffi::Error::InvalidArgument("cpu gemm: 1-8 weights, one output each");
  Work work{};
  work.x = x.typed_data();
  work.rows = xd[0];
  work.k = xd[1];
  work.n_w = n_w;
  for (int64_t m = 0; m < n_w; ++m) {
    auto wm = ws.get<ffi::Buffer<ffi::F32>>(m);
    auto ym = ys.get<ffi::Buffer<ffi::F32>>(m);
    if (!wm.has_value() || !ym.has_value())
      return ffi::Error::InvalidArgument("cpu gemm: weights and outputs must be float32");
    auto wd = wm->dimensions();
    auto yd = (*ym)->dimensions();
    if (wd.size() != 2 || yd.size() != 2 || wd[0] != work.k || yd[0] != work.rows ||
        yd[1] != wd[1])
      return ffi::Error::InvalidArgument("cpu gemm: weight " + std::to_string(m) +
                                         " or its output does not fit x [" +
                                         std::to_string(work.rows) + ", " +
                                         std::to_string(work.k) + "]");
    work.w[m] = wm->typed_data();
    work.y[m] = (*ym)->typed_data();
    work.n[m] = wd[1];
    work.strips += (wd[1] + kStrip - 1) / kStrip;
  }
  if (work.k == 0) {  // nothing to sum: zeros
    for (int64_t m = 0; m < n_w; ++m)
      std::memset(work.y[m], 0, work.rows * work.n[m] * sizeof(float));
    return ffi::Error::Success();
  }
  // One share per thread: RunShared schedules shares - 1 helper tasks (shares <= threads).
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  work.shares = std::max<int64_t>(1, std::min<int64_t>(threads, work.strips));
  jaxkv::RunShared(pool, work.shares, [&work](int64_t s) { run_share(work, s); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvGemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .RemainingArgs()               // weights [K, N_m]
                                  .RemainingRets());             // outputs [T, N_m]
