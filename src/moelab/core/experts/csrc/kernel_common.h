// What the fused expert kernel (experts_cpu.cpp), the quantized decode kernel (quant_cpu.cpp)
// and the dense decode kernel (dense_rows.cpp) share: per-CPU code paths and the adaptive,
// dynamic work-item scheduler.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <initializer_list>
#include <vector>

// One code path per vector width, picked at load time by the CPU's features.
#if defined(__GNUC__) && defined(__x86_64__)
#define MOELAB_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define MOELAB_CLONES
#endif

namespace moelab {

// Adaptive parallelism for decode-sized calls. On a machine whose cores are busy with other
// processes, a worker thread of the parallel region may be descheduled before it starts or in
// the middle of an item; the region's end barrier then waits a scheduler time slice
// (milliseconds) while a decode step's items take microseconds. So a decode-sized call
// (`adaptive`) is run either in parallel or on the calling thread alone (solo), whichever has
// cost less per item lately: each mode keeps an exponential moving average of its wall time
// per item, the cheaper mode runs, and now and then a short run of the other one (a probe)
// keeps its average current: a probe weighs half, a routine call 1/16, so one late parallel
// call puts parallel behind at once and a few fast probes bring it back; probes come every
// kProbeEvery calls, and half as often each time the probed mode loses again (down to one in
// kMaxProbeEvery). On an idle machine parallel wins; on a busy one the averages carry the
// barrier waits and solo wins. Larger calls (prefill, training) run in
// parallel: their work dwarfs a time slice. A decode-sized item (the kernel's own projections)
// computes the same bits on any thread, so a decode step's output does not depend on the
// mode, nor on the machine's load.
// Modes are measured in runs of kRunLength calls, only the run's last call counting: the
// first parallel call after solo ones wakes the worker threads from their sleep (a cost solo
// mode caused), and the very first starts the thread pool.
// Each shape of call keeps its own averages and probe clock (one of kSchedulerSlots slots, by
// a hash of the shape the caller gives): a decode step mixes calls whose items cost 10x
// apart (an 8-bit model's key projection and its LM head, 1 or 8 input rows), so one shared
// average per item compared a probe of the cheap calls with the routine cost of the dear
// ones, and flipped to solo for hundreds of calls on an idle machine. Per shape, a small
// call whose region costs more than it splits runs solo and a large one in parallel. Shapes
// that hash to one slot share it (the heuristic blurs, the values do not change). A caller
// may instead fix the mode of all its calls (thread_mode: the fused decode step chooses one
// per step, from scheduler states of its own, Schedulers::steps).
constexpr int64_t kRunLength = 2;
constexpr int64_t kProbeEvery = 64;        // calls between probes, doubling while the probed
constexpr int64_t kMaxProbeEvery = 4096;   // mode keeps losing, back to 64 when it wins
constexpr int64_t kRoutineWeight = 16;  // EMA step 1/16 for the running mode, 1/2 for probes
constexpr int64_t kProbeWeight = 2;
constexpr int64_t kFirstProbe = 2 * kRunLength + kProbeEvery;  // after the warm-up runs

constexpr int64_t kSlotBits = 8;
constexpr int64_t kSchedulerSlots = int64_t{1} << kSlotBits;

// How run_items runs one call: on the calling thread alone or not, the weight of its cost
// sample in the average (0: not counted) and whether it ends a probe run.
struct ModeChoice {
  bool solo = false;
  int64_t weight = 0;
  bool last_probe = false;
};

struct SchedulerState {
  std::atomic<int64_t> calls{0};           // adaptive calls so far (the probe clock)
  std::atomic<int64_t> parallel_cost{0};   // EMA, ns per item; 0 = not measured yet
  std::atomic<int64_t> solo_cost{0};
  std::atomic<int64_t> probe_every{kProbeEvery};  // calls between probes (backs off)
  std::atomic<int64_t> next_probe{kFirstProbe};
  std::atomic<int64_t> parallel_calls{0};  // statistics (scheduler_stats)
  std::atomic<int64_t> solo_calls{0};

  void reset() {  // back to the initial values above
    calls = 0;
    parallel_cost = 0;
    solo_cost = 0;
    probe_every = kProbeEvery;
    next_probe = kFirstProbe;
    parallel_calls = 0;
    solo_calls = 0;
  }

  bool prefer_solo() const {
    return solo_cost.load(std::memory_order_relaxed) <
           parallel_cost.load(std::memory_order_relaxed);
  }

  // The mode of the next call (see above): a warm-up run of parallel calls, then one of solo
  // ones, each sample replacing the last; then the cheaper mode, but for probe runs of the
  // other one.
  ModeChoice choose() {
    const int64_t c = calls.fetch_add(1, std::memory_order_relaxed);
    if (c < 2 * kRunLength) return {c >= kRunLength, 1, false};
    const int64_t first = next_probe.load(std::memory_order_relaxed);
    const bool probe = c >= first && c < first + kRunLength;
    const int64_t weight =
        !probe ? kRoutineWeight : c == first + kRunLength - 1 ? kProbeWeight : 0;
    return {prefer_solo() != probe, weight, weight == kProbeWeight};
  }

  // A call of `mode` took `ns` per item: into its mode's average, and when the call ended a
  // probe run that lost again, the next probe comes twice as late (up to kMaxProbeEvery).
  void record(const ModeChoice& mode, int64_t ns);
};

struct Schedulers {
  SchedulerState slots[kSchedulerSlots];
  // the fused decode step's (decode_step.cpp), apart from the calls': milliseconds per row
  // where a call's are microseconds per item
  SchedulerState steps[kSchedulerSlots];
  std::atomic<int64_t> forced_solo{0};  // calls still to run solo, any shape (tests, benchmarks)
  std::atomic<int64_t> last{0};         // the slot of the latest adaptive call (statistics)

  void reset(int64_t solo_calls) {  // every slot forgotten, the next solo_calls calls solo
    for (auto& st : slots) st.reset();
    for (auto& st : steps) st.reset();
    forced_solo = solo_calls;
    last = 0;
  }
};

inline Schedulers& schedulers() {
  static Schedulers all;
  return all;
}

// A hash of n numbers: FNV-1a, then MurmurHash3's 64-bit finaliser, so that every bit of
// every number reaches the top bits (FNV-1a alone left the last number's low bits out of
// them: the row counts 1-8 of one projection shared a slot).
inline uint64_t hash_numbers(const int64_t* v, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint64_t>(v[i])) * 1099511628211ull;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  return h ^ (h >> 33);
}

// The slot of a call shape (its hash over the caller's numbers: which kernel, its sizes).
inline int64_t scheduler_slot(std::initializer_list<int64_t> shape) {
  return static_cast<int64_t>(hash_numbers(shape.begin(), shape.size()) >> (64 - kSlotBits));
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ema += (sample - ema) / weight, or sample when unmeasured (races only blur the heuristic).
inline void update_cost(std::atomic<int64_t>& ema, int64_t sample, int64_t weight) {
  const int64_t old = ema.load(std::memory_order_relaxed);
  ema.store(old == 0 ? std::max<int64_t>(sample, 1) : old + (sample - old) / weight,
            std::memory_order_relaxed);
}

inline void SchedulerState::record(const ModeChoice& mode, int64_t ns) {
  if (mode.weight > 0) update_cost(mode.solo ? solo_cost : parallel_cost, ns, mode.weight);
  if (mode.last_probe) {
    const int64_t every = probe_every.load(std::memory_order_relaxed);
    const int64_t gap =
        prefer_solo() != mode.solo ? std::min(2 * every, kMaxProbeEvery) : kProbeEvery;
    probe_every.store(gap, std::memory_order_relaxed);
    next_probe.store(calls.load(std::memory_order_relaxed) + gap, std::memory_order_relaxed);
  }
}

// A mode for every run_items call of the calling thread (the fused decode step chooses one
// for a whole step), or kAuto: each call chooses its own.
enum class Mode { kAuto, kSolo, kParallel };

inline Mode& thread_mode() {
  static thread_local Mode mode = Mode::kAuto;
  return mode;
}

// thread_mode() set for a scope.
class ModeScope {
 public:
  explicit ModeScope(Mode mode) : saved_(thread_mode()) { thread_mode() = mode; }
  ~ModeScope() { thread_mode() = saved_; }
  ModeScope(const ModeScope&) = delete;
  ModeScope& operator=(const ModeScope&) = delete;

 private:
  Mode saved_;
};

// Dynamic scheduling: each thread takes the next item until none is left (callers sort the
// largest first), so a thread that is descheduled for a while delays only the item it holds.
// Autograd and autocast state is thread-local, so every worker enters inference mode and
// leaves autocast itself: the kernels' temporaries never record a graph (the Python
// autograd.Function owns the backward) and their GEMMs keep the inputs' dtype. `adaptive`:
// a decode-sized call, which may run solo (see above). `slot`: the call shape's
// scheduler_slot, whose cost averages it reads and feeds.
template <typename ItemT, typename Fn>
void run_items(const std::vector<ItemT>& items, const Fn& fn, bool adaptive, int64_t slot) {
  Schedulers& all = schedulers();
  SchedulerState& st = all.slots[slot];
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n, 1));
  ModeChoice mode{workers == 1, 0, false};
  if (!mode.solo && all.forced_solo.load(std::memory_order_relaxed) > 0) {
    all.forced_solo.fetch_sub(1, std::memory_order_relaxed);
    mode.solo = true;
    adaptive = false;  // a forced call says nothing about the machine
  } else if (!mode.solo && thread_mode() != Mode::kAuto) {
    mode.solo = thread_mode() == Mode::kSolo;
    adaptive = false;  // the caller measures
  } else if (!mode.solo && adaptive) {
    all.last.store(slot, std::memory_order_relaxed);
    mode = st.choose();
  }
  const auto take_all = [&] {
    c10::InferenceMode guard;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(items[i]);
  };
  const int64_t start = now_ns();
  if (mode.solo) {
    st.solo_calls.fetch_add(1, std::memory_order_relaxed);
    take_all();
  } else {
    st.parallel_calls.fetch_add(1, std::memory_order_relaxed);
    at::parallel_for(0, workers, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) take_all();
    });
  }
  if (adaptive && workers > 1) st.record(mode, (now_ns() - start) / std::max<int64_t>(n, 1));
}

}  // namespace moelab
