// What the fused expert kernel (experts_cpu.cpp) and the quantized decode kernel
// (quant_cpu.cpp) share: per-CPU code paths and the adaptive, dynamic work-item scheduler.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

// One code path per vector width, picked at load time by the CPU's features.
#if defined(__GNUC__) && defined(__x86_64__)
#define MOELAB_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define MOELAB_CLONES
#endif

namespace moelab {

// Adaptive parallelism. On a machine whose cores are busy with other processes, a worker
// thread of the parallel region may be descheduled before it even starts; the region's end
// barrier then waits a scheduler time slice (milliseconds) for a thread that has nothing left
// to do, while a decode step's items take microseconds. Every parallel call therefore checks
// whether its helpers came late: a helper that first arrives after the calling thread has
// finished every item contributed nothing and only delayed the return. After such a call the
// next calls run on the calling thread alone (solo), for a span that doubles with each late
// probe (up to kMaxSoloSpan) and restarts small after an on-time one, so a busy machine costs
// one late call per span, and an idle one goes back to every thread. A decode-sized item (the
// kernel's own projections) computes the same bits on any thread, so a decode step's output
// does not depend on the machine's load; larger items call MKL, which may thread a GEMM
// called outside a parallel region (same values to rounding).
struct SchedulerState {
  std::atomic<int64_t> solo_left{0};   // calls still to run solo
  std::atomic<int64_t> solo_span{1};   // the next span after a late call
  std::atomic<int64_t> late_calls{0};  // statistics (scheduler_stats)
  std::atomic<int64_t> solo_calls{0};
  std::atomic<int64_t> parallel_calls{0};
};
constexpr int64_t kMaxSoloSpan = 4096;

inline SchedulerState& scheduler() {
  static SchedulerState state;
  return state;
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Dynamic scheduling: each thread takes the next item until none is left (callers sort the
// largest first), so a thread that is descheduled for a while delays only the item it holds.
// Autograd and autocast state is thread-local, so every worker enters inference mode and
// leaves autocast itself: the kernels' temporaries never record a graph (the Python
// autograd.Function owns the backward) and their GEMMs keep the inputs' dtype.
template <typename ItemT, typename Fn>
void run_items(const std::vector<ItemT>& items, const Fn& fn) {
  auto& st = scheduler();
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n, 1));
  if (workers > 1 && st.solo_left.load(std::memory_order_relaxed) > 0) {
    st.solo_left.fetch_sub(1, std::memory_order_relaxed);
    workers = 1;
  }
  const auto take_all = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(items[i]);
  };
  if (workers == 1) {
    st.solo_calls.fetch_add(1, std::memory_order_relaxed);
    c10::InferenceMode guard;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    take_all();
    return;
  }
  st.parallel_calls.fetch_add(1, std::memory_order_relaxed);
  std::atomic<int64_t> caller_done{0}, helper_arrival{0};
  at::parallel_for(0, workers, 1, [&](int64_t lo, int64_t hi) {
    if (lo > 0) {  // a helper: note when the latest one first arrived
      const int64_t t = now_ns();
      int64_t seen = helper_arrival.load(std::memory_order_relaxed);
      while (t > seen && !helper_arrival.compare_exchange_weak(seen, t)) {
      }
    }
    c10::InferenceMode guard;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    for (int64_t w = lo; w < hi; ++w) take_all();
    if (lo == 0) caller_done.store(now_ns(), std::memory_order_relaxed);
  });
  if (helper_arrival.load() > caller_done.load()) {
    st.late_calls.fetch_add(1, std::memory_order_relaxed);
    const int64_t span = st.solo_span.load(std::memory_order_relaxed);
    st.solo_left.store(span, std::memory_order_relaxed);
    st.solo_span.store(std::min(2 * span, kMaxSoloSpan), std::memory_order_relaxed);
  } else {
    st.solo_span.store(1, std::memory_order_relaxed);
  }
}

}  // namespace moelab
