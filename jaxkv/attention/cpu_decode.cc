// jaxkv's CPU paged-attention kernel for decode rows: an XLA FFI custom call.
//
// Each row p (a query token that is the last position of its sequence's first ctx[p] keys)
// attends, for each KV head k, its G query heads over keys 0 .. ctx[p]-1 read in place from
// the block-paged pool (tables[p][t / block_size], slot t % block_size): no gather, no copy.
// Output is the softmax state of the per-row path of jaxkv/attention/xla_ragged.py:
//   m[p,k,g]      = max_t s[t],       s[t] = q[p,k,g,:] . K[t,k,:]   (q is already scaled)
//   l[p,k,g]      = sum_t exp(s[t] - m)
//   acc[p,k,g,:]  = sum_t exp(s[t] - m) V[t,k,:]
// and (-inf, 0, 0) for a row with ctx[p] == 0 (padding, or a row of the segment path).
//
// Pool element types (attribute kv_kind): 0 float32; 1 bfloat16 held as uint16 bits;
// 2 float16; 3 one byte (int8 / float8 bits) decoded through a 256-entry float32 table
// (operand lut), always with per-token, per-KV-head bfloat16 scales (k_scale / v_scale, held
// as uint16 bits; ignored, and may be 1-element dummies, for kinds 0-2).
//
// Work items are (row, KV head) pairs, shared through one atomic counter by the calling
// thread and tasks on XLA's intra-op thread pool; tasks that start after the work is gone
// return at once (they hold the shared state, never the call's buffers).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxHeadDim = 512;
constexpr int kMaxGroup = 64;

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp(x) for x <= 0 (scores minus their maximum), vectorizable: 2^(x log2 e) split into the
// nearest integer n and a fraction f in [-1/2, 1/2], a degree-7 Taylor polynomial for 2^f
// (relative error below 1e-8 before float32 rounding), and n put in the exponent bits.
// Below -87 it returns exp(-87) ~ 1.6e-38, which adds nothing next to the maximum's 1.
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
  const float* q;        // [P, K, G, D]
  const void* k;         // [L, NB, BS, K, D]
  const void* v;
  const uint16_t* k_scale;  // [L, NB, BS, K] (kind 3)
  const uint16_t* v_scale;
  const float* lut;      // [256] (kind 3)
  const int32_t* tables;  // [P, NT]
  const int32_t* ctx;     // [P]
  float* m;               // [P, K, G]
  float* l;
  float* acc;             // [P, K, G, D]
  int64_t layer, num_blocks, block_size, kv_heads, group, head_dim, table_cols, kind;
};

// Key/value row t of (row p, KV head kh) as float32 into out[D].
inline void load_row(const Args& a, const void* cache, const uint16_t* scales, int64_t block,
                     int64_t slot, int64_t kh, float* out) {
  const int64_t D = a.head_dim;
  const int64_t tok = (a.layer * a.num_blocks + block) * a.block_size + slot;
  const int64_t off = (tok * a.kv_heads + kh) * D;
  switch (a.kind) {
    case 0: {
      const float* src = static_cast<const float*>(cache) + off;
      for (int64_t d = 0; d < D; ++d) out[d] = src[d];
      break;
    }
    case 1: {
      const uint16_t* src = static_cast<const uint16_t*>(cache) + off;
      for (int64_t d = 0; d < D; ++d) out[d] = bf16_to_float(src[d]);
      break;
    }
    case 2: {
      const _Float16* src = static_cast<const _Float16*>(cache) + off;
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(src[d]);
      break;
    }
    default: {
      const uint8_t* src = static_cast<const uint8_t*>(cache) + off;
      const float s = bf16_to_float(scales[tok * a.kv_heads + kh]);
      for (int64_t d = 0; d < D; ++d) out[d] = a.lut[src[d]] * s;
      break;
    }
  }
}

// Pointer to row t when the pool is float32 (no conversion needed), else nullptr.
inline const float* direct_row(const Args& a, const void* cache, int64_t block, int64_t slot,
                               int64_t kh) {
  if (a.kind != 0) return nullptr;
  const int64_t tok = (a.layer * a.num_blocks + block) * a.block_size + slot;
  return static_cast<const float*>(cache) + (tok * a.kv_heads + kh) * a.head_dim;
}

// One work item: row p, KV heads kh0 .. kh0 + KH - 1 (all of them when there are enough rows
// to keep the threads busy: a block's K/V rows are then read as one contiguous run).
void attend_item(const Args& a, int64_t p, int64_t kh0, int64_t KH,
                 std::vector<float>& scores) {
  const int64_t G = a.group, D = a.head_dim, H = KH * G;
  const int64_t n = a.ctx[p];
  const int64_t first = p * a.kv_heads + kh0;  // (row, KV head) index of the first head
  float* m = a.m + first * G;
  float* l = a.l + first * G;
  float* acc = a.acc + first * G * D;
  if (n <= 0) {
    for (int64_t h = 0; h < H; ++h) {
      m[h] = -std::numeric_limits<float>::infinity();
      l[h] = 0.0f;
    }
    std::fill(acc, acc + H * D, 0.0f);
    return;
  }
  const float* q = a.q + first * G * D;
  const int32_t* table = a.tables + p * a.table_cols;
  if (static_cast<int64_t>(scores.size()) < H * n) scores.resize(H * n);
  float buf[kMaxHeadDim];
  // Scores, key by key: each key row is read once for its G query heads (s[h * n + t]).
  for (int64_t t = 0; t < n; ++t) {
    const int64_t block = table[t / a.block_size], slot = t % a.block_size;
    for (int64_t kh = 0; kh < KH; ++kh) {
      const float* kr = direct_row(a, a.k, block, slot, kh0 + kh);
      if (kr == nullptr) {
        load_row(a, a.k, a.k_scale, block, slot, kh0 + kh, buf);
        kr = buf;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + (kh * G + g) * D;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * kr[d];
        scores[(kh * G + g) * n + t] = s;
      }
    }
  }
  // Softmax pieces per query head.
  for (int64_t h = 0; h < H; ++h) {
    float* s = scores.data() + h * n;
    float mx = s[0];
    for (int64_t t = 1; t < n; ++t) mx = std::max(mx, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = exp_nonpositive(s[t] - mx);
      sum += s[t];
    }
    m[h] = mx;
    l[h] = sum;
  }
  // Weighted values: each value row read once for its G query heads.
  std::fill(acc, acc + H * D, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t block = table[t / a.block_size], slot = t % a.block_size;
    for (int64_t kh = 0; kh < KH; ++kh) {
      const float* vr = direct_row(a, a.v, block, slot, kh0 + kh);
      if (vr == nullptr) {
        load_row(a, a.v, a.v_scale, block, slot, kh0 + kh, buf);
        vr = buf;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float w = scores[(kh * G + g) * n + t];
        float* ag = acc + (kh * G + g) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += w * vr[d];
      }
    }
  }
}

struct Work {
  Args args;
  int64_t total;
  int64_t heads_per_item;  // KV heads of one work item: all, or 1 when rows are few
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void run_items(Work& w) {
  std::vector<float> scores;
  int64_t finished = 0;
  for (int64_t i; (i = w.next.fetch_add(1, std::memory_order_relaxed)) < w.total;) {
    const int64_t per_row = w.args.kv_heads / w.heads_per_item;
    attend_item(w.args, i / per_row, (i % per_row) * w.heads_per_item, w.heads_per_item,
                scores);
    ++finished;
  }
  if (finished) w.done.fetch_add(finished, std::memory_order_acq_rel);
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::Buffer<ffi::U16> k_scale,
                           ffi::Buffer<ffi::U16> v_scale, ffi::Buffer<ffi::F32> lut,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> ctx,
                           int64_t layer, int64_t kind,
                           ffi::Result<ffi::Buffer<ffi::F32>> m,
                           ffi::Result<ffi::Buffer<ffi::F32>> l,
                           ffi::Result<ffi::Buffer<ffi::F32>> acc) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged_decode: q must be 4-D, the pool 5-D, tables 2-D");
  Args a{};
  a.q = q.typed_data();
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.k_scale = k_scale.typed_data();
  a.v_scale = v_scale.typed_data();
  a.lut = lut.typed_data();
  a.tables = tables.typed_data();
  a.ctx = ctx.typed_data();
  a.m = m->typed_data();
  a.l = l->typed_data();
  a.acc = acc->typed_data();
  a.layer = layer;
  a.num_blocks = kd[1];
  a.block_size = kd[2];
  a.kv_heads = kd[3];
  a.head_dim = kd[4];
  a.group = qd[2];
  a.table_cols = td[1];
  a.kind = kind;
  if (qd[1] != a.kv_heads || qd[3] != a.head_dim || td[0] != qd[0])
    return ffi::Error::InvalidArgument("paged_decode: q, pool and tables disagree");
  if (a.head_dim > kMaxHeadDim || a.group > kMaxGroup || layer < 0 || layer >= kd[0])
    return ffi::Error::InvalidArgument("paged_decode: head_dim, group or layer out of range");
  auto work = std::make_shared<Work>();
  work->args = a;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  work->heads_per_item = qd[0] >= 4 * threads ? a.kv_heads : 1;
  work->total = qd[0] * (a.kv_heads / work->heads_per_item);
  const int64_t helpers = std::min<int64_t>(threads - 1, work->total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { run_items(*work); });
  run_items(*work);
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k pool
                                  .Arg<ffi::AnyBuffer>()         // v pool
                                  .Arg<ffi::Buffer<ffi::U16>>()  // k_scale
                                  .Arg<ffi::Buffer<ffi::U16>>()  // v_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lut
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ctx
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("kind")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m
                                  .Ret<ffi::Buffer<ffi::F32>>()  // l
                                  .Ret<ffi::Buffer<ffi::F32>>());  // acc
