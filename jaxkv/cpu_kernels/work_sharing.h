// jaxkv's work sharing over XLA's intra-op thread pool, written once for the four kernels
// (attention.cc, linear.cc, gemm.cc, argmax.cc).
//
// jaxkv::RunShared(pool, items, item) calls item(i) once for each i in [0, items) and returns
// when every call has returned. The items are taken in increasing order from one atomic
// counter by the calling thread and by min(threads - 1, items - 1) helper tasks scheduled on
// the pool (threads = pool.num_threads(), at least 1): the caller works too, then waits,
// yielding, until all items are done. Which thread runs an item depends on the timing, so a
// kernel's result must not (each kernel's sums are fixed by the item, never by the thread).
//
// Lifetime: the counters live in a record that the caller and every helper task hold through a
// shared_ptr. A task that starts after the items are gone, even after the kernel has returned,
// only takes a number past the end from `next` and returns; the record lives until the last
// holder lets go. `item` is copied into the record but called only for items taken while the
// caller is still waiting, so it may refer to the kernel's own state (on its stack) by
// reference.
//
// Ordering: each thread adds the number of items it ran to `done` (acq_rel) after running them;
// the caller's acquire load of `done` then sees every item's writes.

#ifndef JAXKV_CPU_KERNELS_WORK_SHARING_H_
#define JAXKV_CPU_KERNELS_WORK_SHARING_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxkv {

template <typename Fn>
void RunShared(xla::ffi::ThreadPool& pool, int64_t items, Fn item) {
  if (items <= 0) return;
  struct Shared {
    Shared(int64_t n, Fn f) : items(n), item(std::move(f)) {}
    // Runs items until none is left; counts them in `done` once, at the end.
    void Run() {
      int64_t finished = 0;
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items; ++finished)
        item(i);
      if (finished) done.fetch_add(finished, std::memory_order_acq_rel);
    }
    const int64_t items;
    Fn item;
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>(items, std::move(item));
  const int64_t helpers =
      std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1) - 1, items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->Run(); });
  shared->Run();
  while (shared->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace jaxkv

#endif  // JAXKV_CPU_KERNELS_WORK_SHARING_H_
