// What the fused expert kernel (experts_cpu.cpp) and the quantized decode kernel
// (quant_cpu.cpp) share: per-CPU code paths and the dynamic work-item scheduler.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

// One code path per vector width, picked at load time by the CPU's features.
#if defined(__GNUC__) && defined(__x86_64__)
#define MOELAB_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define MOELAB_CLONES
#endif

namespace moelab {

// Dynamic scheduling: each thread takes the next item until none is left (callers sort the
// largest first), so a thread that is descheduled for a while delays only the item it holds.
// Autograd and autocast state is thread-local, so every worker enters inference mode and
// leaves autocast itself: the kernels' temporaries never record a graph (the Python
// autograd.Function owns the backward) and their GEMMs keep the inputs' dtype.
template <typename ItemT, typename Fn>
void run_items(const std::vector<ItemT>& items, const Fn& fn) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n, 1));
  at::parallel_for(0, workers, 1, [&](int64_t lo, int64_t hi) {
    c10::InferenceMode guard;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    for (int64_t w = lo; w < hi; ++w) {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(items[i]);
    }
  });
}

}  // namespace moelab
