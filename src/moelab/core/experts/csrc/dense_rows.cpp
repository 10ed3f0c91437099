// nn.Linear at a decode step: y [M, N] = x [M, K] · w [N, K]ᵀ (+ bias) for 1-8 float32 rows.
// MKL's GEMM and GEMV read a [N, K] weight at a fraction of the memory bandwidth when M is
// this small (benchmarks/decode_linear.py), though each weight needs reading only once: here
// every weight row is streamed once (one row for all input rows, or register tiles of 4
// weight rows x 4 input rows: dot_rows_m), each output accumulated in 16-lane partial sums
// that are reduced in a fixed order. An output's
// value therefore does not depend on the other rows of the call, nor on the thread that
// computes it. Blocks of output features are work items for the adaptive scheduler of
// kernel_common.h (its averages kept per projection shape and row count).
#include "dense_rows.h"

#include <cstring>
#include <utility>
#include <vector>

#include "kernel_common.h"

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kLanes = 16;

// 16 float lanes as one value (GCC/Clang vector extension): one AVX-512 register, two AVX2
// ones. Accumulators of this type stay in registers, where float arrays indexed in the final
// reduction would be kept on the stack and reloaded at every multiply-add.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

__attribute__((always_inline)) inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// An output's 16 partial sums t[0..15] are added by pairwise halving, t[l] += t[l + w] for
// w = 8, 4, 2, 1, in vector registers for a whole tile at once: a scalar reduction per
// output took about as long as the multiply-adds of a 576-wide row. fold<w>(a, b) is one
// halving step for the accumulators packed in a and b (each vector holds 2w lanes of each
// of its 8 / w accumulators): the w sums left of each of a's accumulators, then of b's.
__attribute__((always_inline)) inline Lanes fold8(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                 31);
}
__attribute__((always_inline)) inline Lanes fold4(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
__attribute__((always_inline)) inline Lanes fold2(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
__attribute__((always_inline)) inline Lanes fold1(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                 31);
}

// The sums of acc[0 .. n-1] (n <= 16) in the halving order, acc[i]'s as lane i of the
// result (the missing accumulators are zeros).
template <int64_t n>
__attribute__((always_inline)) inline Lanes reduce_tile(const Lanes* acc) {
  Lanes v[kLanes];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kLanes; ++i) v[i] = i < n ? acc[i] : Lanes{};
#pragma GCC unroll 8
  for (int64_t i = 0; i < 8; ++i) v[i] = fold8(v[2 * i], v[2 * i + 1]);
#pragma GCC unroll 4
  for (int64_t i = 0; i < 4; ++i) v[i] = fold4(v[2 * i], v[2 * i + 1]);
  v[0] = fold2(v[0], v[1]);
  v[1] = fold2(v[2], v[3]);
  return fold1(v[0], v[1]);
}

// out[m, o] for the weight rows o0 .. o0 + R - 1 and M input rows: a register tile of
// R x M <= 16 accumulators, so each loaded weight vector serves M rows and each loaded input
// vector R weight rows.
// `Prefetch`: also ask for the next tile's weights, the same columns R rows on. With 3 or more
// input rows a tile's multiply-adds take longer, and the hardware prefetchers apparently fall
// behind: prefetching one tile ahead read an LM head-sized weight 8 % faster at 4 rows and
// 20 % at 8 in 4-row tiles (scratch measurement interleaved with the read floor), and made no
// difference or slowed 1-2 rows; one-row reads at 3-5 input rows keep it (measured with it,
// not apart). Prefetches past the weight's end are harmless: they never fault.
template <int64_t R, int64_t M, bool Prefetch>
__attribute__((always_inline)) inline void dot_tile(const float* x, int64_t K, const float* w,
                                                    int64_t o0, const float* bias, float* out,
                                                    int64_t N) {
  static_assert(R * M <= kLanes, "a tile's sums fill one vector");
  Lanes acc[R * M];
#pragma GCC unroll 16
  for (int64_t i = 0; i < R * M; ++i) acc[i] = Lanes{};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Lanes xv[M], wv[R];
#pragma GCC unroll 16
    for (int64_t m = 0; m < M; ++m) xv[m] = load_lanes(x + m * K + k);
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) wv[r] = load_lanes(w + (o0 + r) * K + k);
    if constexpr (Prefetch) {
#pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) __builtin_prefetch(w + (o0 + R + r) * K + k);
    }
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int64_t m = 0; m < M; ++m) acc[r * M + m] += xv[m] * wv[r];
  }
  float sums[kLanes];
  const Lanes reduced = reduce_tile<R * M>(acc);
  std::memcpy(sums, &reduced, sizeof(sums));
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t m = 0; m < M; ++m) {
      float s = sums[r * M + m];
      for (int64_t j = k; j < K; ++j) s += x[m * K + j] * w[(o0 + r) * K + j];
      out[m * N + o0 + r] = bias != nullptr ? s + bias[o0 + r] : s;
    }
  }
}

// Weight rows o .. o + R - 1 for M <= 8 input rows: one weight row for all of them, or a
// tile of 4 weight rows in groups of at most 4 input rows (the second group reads the tile's
// weights while they are in L1; only the first prefetches).
template <int64_t R, int64_t M>
__attribute__((always_inline)) inline void dot_rows_tile(const float* x, int64_t K,
                                                         const float* w, int64_t o,
                                                         const float* bias, float* out,
                                                         int64_t N) {
  constexpr bool kPrefetch = M >= 3;
  if constexpr (R == 1 || M <= 4) {
    dot_tile<R, M, kPrefetch>(x, K, w, o, bias, out, N);
  } else {
    dot_tile<R, 4, kPrefetch>(x, K, w, o, bias, out, N);
    dot_tile<R, M - 4, false>(x + 4 * K, K, w, o, bias, out + 4 * N, N);
  }
}

// Output features [o0, o1) for M <= 8 input rows. Up to 5 input rows, one weight row at a
// time: the weight is then read as one sequential stream, which the hardware prefetchers
// follow best (an LM head-sized weight read at 1.07x, 1.25x, 1.09x the speed of the earlier
// tiles, 8 weight rows at 1-2 input rows and 4 at 3-5, at 1, 2 and 4 input rows on an idle
// host: scratch measurement, interleaved with the read floor, 22 rounds). With more input rows the loads of x would bound a row's loop: tiles of 4
// weight rows (4 x 4 accumulators), then the rows left one at a time.
template <int64_t M>
MOELAB_CLONES void dot_rows_m(const float* x, int64_t K, const float* w, int64_t o0, int64_t o1,
                              const float* bias, float* out, int64_t N) {
  constexpr int64_t R = M <= 5 ? 1 : 4;
  int64_t o = o0;
  for (; o + R <= o1; o += R) dot_rows_tile<R, M>(x, K, w, o, bias, out, N);
  for (; o < o1; ++o) dot_rows_tile<1, M>(x, K, w, o, bias, out, N);
}

template <int64_t... Ms>
void dot_rows(std::integer_sequence<int64_t, Ms...>, int64_t M, const float* x, int64_t K,
              const float* w, int64_t o0, int64_t o1, const float* bias, float* out, int64_t N) {
  ((M == Ms + 1 ? dot_rows_m<Ms + 1>(x, K, w, o0, o1, bias, out, N) : void()), ...);
}

struct Block {
  int64_t job, begin, end;  // output features [begin, end) of projection `job`
};

}  // namespace

std::vector<at::Tensor> dense_rows_many(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                                        const std::vector<c10::optional<at::Tensor>>& biases) {
  TORCH_CHECK(!ws.empty() && ws.size() == biases.size(),
              "dense_rows: one bias (or none) per weight, at least one weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "dense_rows: float32 only, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "dense_rows: x must be contiguous [1..", kMaxRows, ", K]");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t total = 0;
  std::vector<const float*> b(ws.size(), nullptr);
  for (size_t j = 0; j < ws.size(); ++j) {
    const auto& w = ws[j];
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous() &&
                    w.size(1) == K,
                "dense_rows: w must be contiguous [N, ", K, "] float32, got ", w.scalar_type(),
                " ", w.sizes());
    const auto& bias = biases[j];
    if (bias.has_value()) {
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                      bias->dim() == 1 && bias->size(0) == w.size(0),
                  "dense_rows: bias must be contiguous float32 [", w.size(0), "]");
      b[j] = bias->data_ptr<float>();
    }
    total += w.size(0);
  }
  // kItemsPerThread blocks of output features per thread over all the projections (dynamic
  // balance), of >= 4 rows
  constexpr int64_t kItemsPerThread = 8;
  const int64_t per = kItemsPerThread * at::get_num_threads();
  const int64_t block = std::max<int64_t>(4, (total + per - 1) / per);
  std::vector<Block> blocks;
  std::vector<at::Tensor> ys;
  std::vector<const float*> wp;
  std::vector<float*> yp;
  for (size_t j = 0; j < ws.size(); ++j) {
    const int64_t N = ws[j].size(0);
    for (int64_t o = 0; o < N; o += block)
      blocks.push_back({static_cast<int64_t>(j), o, std::min(N, o + block)});
    ys.push_back(at::empty({M, N}, x.options()));
    wp.push_back(ws[j].data_ptr<float>());
    yp.push_back(ys.back().data_ptr<float>());
  }
  const float* xp = x.data_ptr<float>();
  moelab::run_items(
      blocks,
      [&](const Block& it) {
        dot_rows(std::make_integer_sequence<int64_t, kMaxRows>(), M, xp, K, wp[it.job], it.begin,
                 it.end, b[it.job], yp[it.job], ws[it.job].size(0));
      },
      /*adaptive=*/true, moelab::scheduler_slot({4, K, total, M}));
  return ys;
}

at::Tensor dense_rows(const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2, "dense_rows: x [..., K] and w [N, K] expected");
  auto y = dense_rows_many(x.reshape({-1, x.size(-1)}).contiguous(), {w}, {bias})[0];
  auto sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  return y.view(sizes);
}
