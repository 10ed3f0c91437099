// Fused CPU expert kernel: every expert's whole feed-forward chain (gather, input projection,
// activation, output projection, scatter) as one work item, the items spread over the intra-op
// threads, each running single-threaded GEMMs. See moelab/core/experts/cpu_kernel.py.
// ATen and the pybind casters only: torch/extension.h adds the whole C++ frontend, and
// compiling it takes a minute where this takes 30-40 s.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "decode_step.h"
#include "dense_rows.h"
#include "experts_cpu.h"
#include "kernel_common.h"
#include "quant_cpu.h"
#include "quant_int8.h"

namespace {

// Activation codes (cpu_kernel.ACTIVATIONS): 0 swiglu, 1 geglu, 2 gelu, 3 gelu_tanh.
bool gated(int64_t act) { return act == 0 || act == 1; }

at::Tensor act_fn(const at::Tensor& z, int64_t act) {
  if (act == 0) return at::silu(z);
  if (act == 1 || act == 3) return at::gelu(z, "tanh");
  return at::gelu(z);
}

at::Tensor act_grad(const at::Tensor& grad, const at::Tensor& z, int64_t act) {
  if (act == 0) return at::silu_backward(grad, z);
  if (act == 1 || act == 3) return at::gelu_backward(grad, z, "tanh");
  return at::gelu_backward(grad, z);
}

// act(z) into `out` (same shape).
void act_fn_out(at::Tensor& out, const at::Tensor& z, int64_t act) {
  if (act == 0) {
    at::silu_out(out, z);
  } else if (act == 1 || act == 3) {
    at::gelu_out(out, z, "tanh");
  } else {
    at::gelu_out(out, z);
  }
}

// A decode-sized part's activation, contiguous [rows, cols]: act(g) * up (gated, `up`
// defined) or act(g). ATen computes the last values of each inner loop in scalar code, whose
// bits differ from the vectorised ones, and how it loops depends on the layout: a gated
// part's gate and up are column slices of a wider buffer in both plans, so ATen loops over
// them alike, but a non-gated part is a contiguous buffer of its own as a part's item (one
// flat loop over all its rows) and a column slice of the whole expert's otherwise. So a
// non-gated part of several rows runs row by row, which gives each row the same loop in both
// plans and whatever the number of rows beside it.
at::Tensor activate_part(const at::Tensor& g, const at::Tensor& up, int64_t act) {
  if (g.size(0) == 1 || up.defined())
    return (up.defined() ? act_fn(g, act).mul_(up) : act_fn(g, act)).contiguous();
  auto a = at::empty(g.sizes(), g.options());
  for (int64_t r = 0; r < g.size(0); ++r) {
    auto row = a.select(0, r);
    act_fn_out(row, g.select(0, r), act);
  }
  return a;
}

// a = act(gate) * up for gated activations, act(h) otherwise.
at::Tensor activate(const at::Tensor& h, int64_t act, int64_t F) {
  if (!gated(act)) return act_fn(h, act);
  return act_fn(h.narrow(1, 0, F), act).mul_(h.narrow(1, F, F));
}

// Decode-sized experts. For 1-8 rows MKL's sgemm reads the weights at 25-55 % of the memory
// bandwidth (benchmarks/decode_experts.py), though these rows need each weight read only once:
// small_rows_mm streams the weight row by row, each row updating every output row's block of
// accumulators while it is in L1 (a block of kColBlock columns keeps 8 rows' accumulators at
// 32 KB; one or two rows take kWideColBlock columns, so that a whole expert's input
// projection row, gate and up, is one contiguous read). An expert's output projection is
// computed as kParts partial outputs over slices of its hidden width F, summed afterwards in
// a fixed order. When the decode-sized experts do not divide evenly among the threads, each
// part is its own work item (with its share of the input projection and the activation): at
// a decode step a few experts take all the time, and whole experts would leave a thread
// idle. Otherwise an item takes a whole expert, all its parts: at batch 1 on SmolLM2-MoE's
// experts (2 per layer, 2 threads) this took 9 % less time than one item per part (scratch
// measurement, interleaved, 9 repeats). Both plans compute every column and every part with
// the same sums in the same order, so a row's result does not depend on which rows share its
// expert or on the plan, and a batched decode gives the same rows as decoding each sequence
// alone (bit for bit on one build: the compiler may fuse a multiply-add differently in
// another).
constexpr int64_t kSmallRows = 8;
constexpr int64_t kColBlock = 1024;
constexpr int64_t kWideColBlock = 4096;
constexpr int64_t kParts = 2;

// out[M, N] = x[M, K] · w[K, N], row-major with row strides ldx, ldw, ldo. M is a template
// argument so that the loop over rows unrolls inside the vectorised loop over columns: each
// weight vector is loaded once for all M rows. The multiply-adds are explicit fused ones: the
// compiler's own contraction may differ between the vectorised body and the scalar tail of
// the column loop, and then a column's bits would depend on where its block starts.
template <int64_t M>
MOELAB_CLONES void small_rows_mm_m(const float* x, int64_t ldx, int64_t K, const float* w,
                                   int64_t ldw, int64_t N, float* out, int64_t ldo) {
  constexpr int64_t kBlock = M <= 2 ? kWideColBlock : kColBlock;
  alignas(64) float acc[M][kBlock];
  for (int64_t j0 = 0; j0 < N; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, N - j0);
    for (int64_t m = 0; m < M; ++m) std::fill_n(acc[m], nb, 0.f);
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {  // four weight rows per accumulator pass
      const float* __restrict w0 = w + k * ldw + j0;
      const float *__restrict w1 = w0 + ldw, *__restrict w2 = w1 + ldw, *__restrict w3 = w2 + ldw;
      float a[M][4];
      for (int64_t m = 0; m < M; ++m)
        for (int64_t q = 0; q < 4; ++q) a[m][q] = x[m * ldx + k + q];
      for (int64_t j = 0; j < nb; ++j) {
        const float v0 = w0[j], v1 = w1[j], v2 = w2[j], v3 = w3[j];
        for (int64_t m = 0; m < M; ++m) {
          float t = a[m][0] * v0;
          t = std::fma(a[m][1], v1, t);
          t = std::fma(a[m][2], v2, t);
          acc[m][j] += std::fma(a[m][3], v3, t);
        }
      }
    }
    for (; k < K; ++k) {
      const float* __restrict w0 = w + k * ldw + j0;
      for (int64_t m = 0; m < M; ++m) {
        const float a0 = x[m * ldx + k];
        for (int64_t j = 0; j < nb; ++j) acc[m][j] = std::fma(a0, w0[j], acc[m][j]);
      }
    }
    for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * ldo + j0, acc[m], nb * sizeof(float));
  }
}

template <int64_t... Ms>
void small_rows_mm(std::integer_sequence<int64_t, Ms...>, int64_t M, const float* x,
                   int64_t ldx, int64_t K, const float* w, int64_t ldw, int64_t N, float* out,
                   int64_t ldo) {
  TORCH_CHECK(M >= 1 && M <= kSmallRows, "small_rows_mm: ", M, " rows");
  ((M == Ms + 1 ? small_rows_mm_m<Ms + 1>(x, ldx, K, w, ldw, N, out, ldo) : void()), ...);
}

// out [M, N] = a [M, K] · w [K, N] with row stride ldw (out and a: any row stride, unit
// column stride).
void small_project(at::Tensor& out, const at::Tensor& a, const float* w, int64_t ldw) {
  TORCH_CHECK(a.stride(1) == 1 && out.stride(1) == 1, "small_project: unit column strides");
  small_rows_mm(std::make_integer_sequence<int64_t, kSmallRows>(), a.size(0), a.data_ptr<float>(),
                a.stride(0), a.size(1), w, ldw, out.size(1), out.data_ptr<float>(),
                out.stride(0));
}

bool small_rows_apply(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& w_down) {
  return x.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat &&
         w_down.scalar_type() == at::kFloat && w_in.is_contiguous() && w_down.is_contiguous();
}

struct Item {
  int64_t expert, begin, rows;
  int64_t part = -1;  // a decode-sized expert's first part of F (0..kParts-1), or -1: not split
  int64_t span = 1;   // parts from `part` on that the item computes (1 or kParts)
};

std::vector<int64_t> offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> start(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) start[e + 1] = start[e] + counts[e];
  return start;
}

std::vector<Item> plan_items(const std::vector<int64_t>& counts, int64_t max_rows,
                             bool split_small) {
  const auto start = offsets(counts);
  const auto small = [&](size_t e) { return counts[e] > 0 && counts[e] <= kSmallRows; };
  int64_t n_small = 0;
  for (size_t e = 0; e < counts.size(); ++e) n_small += small(e);
  const int64_t span = n_small % at::get_num_threads() == 0 ? kParts : 1;
  std::vector<Item> items;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (split_small && small(e)) {
      for (int64_t p = 0; p < kParts; p += span)
        items.push_back({static_cast<int64_t>(e), start[e], counts[e], p, span});
      continue;
    }
    for (int64_t b = 0; b < counts[e]; b += max_rows) {
      items.push_back({static_cast<int64_t>(e), start[e] + b, std::min(max_rows, counts[e] - b)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.rows > b.rows; });
  return items;
}

// Rows [begin, begin + rows) of `t`, or of t[index] when `index` is defined (a row-wise
// memcpy: index_select/index_copy_ parallelise internally, which a worker thread cannot use).
at::Tensor rows_of(const at::Tensor& t, const c10::optional<at::Tensor>& index, int64_t begin,
                   int64_t rows) {
  if (!index.has_value()) return t.narrow(0, begin, rows);
  TORCH_CHECK(t.is_contiguous(), "rows_of: the source must be contiguous");
  auto out = at::empty({rows, t.size(1)}, t.options());
  const int64_t bytes = t.size(1) * t.element_size();
  const auto* idx = index->data_ptr<int64_t>() + begin;
  const auto* from = static_cast<const char*>(t.data_ptr());
  auto* to = static_cast<char*>(out.data_ptr());
  for (int64_t r = 0; r < rows; ++r) std::memcpy(to + r * bytes, from + idx[r] * bytes, bytes);
  return out;
}

// out[index[begin + r]] = value[r] (the un-permutation into pair order).
void put_rows(at::Tensor& out, const at::Tensor& index, int64_t begin, const at::Tensor& value) {
  const int64_t rows = value.size(0);
  TORCH_CHECK(value.scalar_type() == out.scalar_type() && value.is_contiguous() &&
                  value.size(1) == out.size(1),
              "put_rows: rows of ", value.scalar_type(), " into ", out.scalar_type());
  const int64_t bytes = out.size(1) * out.element_size();
  const auto* idx = index.data_ptr<int64_t>() + begin;
  const auto* from = static_cast<const char*>(value.data_ptr());
  auto* to = static_cast<char*>(out.data_ptr());
  for (int64_t r = 0; r < rows; ++r) std::memcpy(to + idx[r] * bytes, from + r * bytes, bytes);
}

// The memcpy paths trust the indices: check them once, before any thread starts. Output
// indices must also be distinct (two workers must never write one row).
void check_index(const c10::optional<at::Tensor>& index, int64_t n, int64_t bound,
                 const char* name, bool distinct = false) {
  if (!index.has_value()) return;
  TORCH_CHECK(index->scalar_type() == at::kLong && index->is_contiguous() && index->dim() == 1 &&
                  index->size(0) == n,
              name, ": expected a contiguous int64 vector of ", n, " rows");
  const auto* idx = index->data_ptr<int64_t>();
  std::vector<bool> seen(distinct ? bound : 0, false);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(idx[r] >= 0 && idx[r] < bound, name, "[", r, "] = ", idx[r], " outside [0, ",
                bound, ")");
    if (distinct) {
      TORCH_CHECK(!seen[idx[r]], name, ": row ", idx[r], " appears twice");
      seen[idx[r]] = true;
    }
  }
}

void check_weights(const at::Tensor& w_in, const at::Tensor& w_down,
                   const std::vector<int64_t>& counts, int64_t act) {
  TORCH_CHECK(w_in.dim() == 3 && w_down.dim() == 3 && w_in.size(0) == w_down.size(0) &&
                  w_in.size(1) == w_down.size(2),
              "weights: expected w_in [E, D, W] and w_down [E, F, D]");
  const int64_t F = w_down.size(1);
  TORCH_CHECK(w_in.size(2) == (gated(act) ? 2 * F : F), "w_in: width ", w_in.size(2),
              " does not match F = ", F);
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == w_in.size(0), "counts: ", counts.size(),
              " entries for ", w_in.size(0), " experts");
  for (auto c : counts) TORCH_CHECK(c >= 0, "counts: negative entry");
}

}  // namespace

// Rows per work item: very large experts are tiled so that every thread gets work in a
// skewed plan (kItemsPerThread items per thread), in tiles of at least kMinTileRows rows.
// experts_forward takes it when given max_rows <= 0.
int64_t max_tile_rows(int64_t rows) {
  constexpr int64_t kItemsPerThread = 4, kMinTileRows = 256;
  const int64_t per = kItemsPerThread * at::get_num_threads();
  return std::max(kMinTileRows, (rows + per - 1) / per);
}

// y[dst[r]] = expert_e(x[src[r]]) for the sorted rows r of expert e (src, dst default to r).
// Returns (y [n_out, D], h [N, W] input projections when save_h, else an empty tensor).
std::vector<at::Tensor> experts_forward(const at::Tensor& x, const at::Tensor& w_in,
                                        const at::Tensor& w_down, std::vector<int64_t> counts,
                                        int64_t act, c10::optional<at::Tensor> src,
                                        c10::optional<at::Tensor> dst, int64_t n_out,
                                        bool save_h, int64_t max_rows) {
  check_weights(w_in, w_down, counts, act);
  const int64_t F = w_down.size(1);
  int64_t N = 0;
  for (auto c : counts) N += c;
  if (max_rows <= 0) max_rows = max_tile_rows(N);
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.size(1) == w_in.size(1),
              "x: expected contiguous [rows, D]");
  check_index(src, N, x.size(0), "src");
  check_index(dst, N, n_out, "dst", true);
  TORCH_CHECK(src.has_value() || x.size(0) == N, "x has ", x.size(0), " rows, counts sum to ", N);
  auto y = at::empty({n_out, w_down.size(2)}, x.options());
  auto h_all = save_h ? at::empty({N, w_in.size(2)}, x.options()) : at::Tensor();
  const bool split = small_rows_apply(x, w_in, w_down);
  const auto items = plan_items(counts, max_rows, split);
  const int64_t D = w_in.size(1), W = w_in.size(2), Dout = w_down.size(2);
  // the split experts' partial outputs, one [N, Dout] slab per part (every row a split item
  // owns is written; the others are never read)
  const bool any_split =
      std::any_of(items.begin(), items.end(), [](const Item& it) { return it.part >= 0; });
  auto parts = any_split ? at::empty({kParts, N, Dout}, x.options()) : at::Tensor();
  // a decode step at inference: every expert decode-sized (computed in parts)
  const bool decode = !save_h && !items.empty() &&
                      std::all_of(items.begin(), items.end(), [](const Item& it) { return it.part >= 0; });
  moelab::run_items(items, [&](const Item& it) {
    const auto xe = rows_of(x, src, it.begin, it.rows);
    if (it.part >= 0) {
      const auto bound = [F](int64_t p) { return p * F / kParts; };  // part p: [bound(p), bound(p+1))
      const int64_t f0 = bound(it.part), fw = bound(it.part + it.span) - f0;
      const float* wi = w_in.data_ptr<float>() + it.expert * D * W;
      const float* wd = w_down.data_ptr<float>() + it.expert * F * Dout;
      const auto xc = xe.contiguous();
      at::Tensor gate, up;
      if (fw == F) {  // the whole expert: its input projection row by row in one read
        auto hb = save_h ? h_all.narrow(0, it.begin, it.rows) : at::empty({it.rows, W}, x.options());
        small_project(hb, xc, wi, W);
        gate = hb.narrow(1, 0, F);
        if (gated(act)) up = hb.narrow(1, F, F);
      } else {
        if (save_h) {
          const auto hb = h_all.narrow(0, it.begin, it.rows);
          gate = hb.narrow(1, f0, fw);
          if (gated(act)) up = hb.narrow(1, F + f0, fw);
        } else {
          const auto hb = at::empty({it.rows, gated(act) ? 2 * fw : fw}, x.options());
          gate = hb.narrow(1, 0, fw);
          if (gated(act)) up = hb.narrow(1, fw, fw);
        }
        small_project(gate, xc, wi + f0, W);
        if (gated(act)) small_project(up, xc, wi + F + f0, W);
      }
      for (int64_t p = it.part; p < it.part + it.span; ++p) {
        // per part, as a part's own item computes it (activate_part)
        const int64_t c0 = bound(p) - f0, cw = bound(p + 1) - bound(p);
        const auto a = activate_part(gate.narrow(1, c0, cw),
                                     gated(act) ? up.narrow(1, c0, cw) : at::Tensor(), act);
        auto part = parts[p].narrow(0, it.begin, it.rows);
        small_project(part, a, wd + bound(p) * Dout, Dout);
      }
      return;
    }
    at::Tensor h;
    if (save_h) {
      h = h_all.narrow(0, it.begin, it.rows);
      at::mm_out(h, xe, w_in[it.expert]);
    } else {
      h = at::mm(xe, w_in[it.expert]);
    }
    const auto a = activate(h, act, F);
    if (dst.has_value()) {
      put_rows(y, *dst, it.begin, at::mm(a, w_down[it.expert]));
    } else {
      auto ye = y.narrow(0, it.begin, it.rows);
      at::mm_out(ye, a, w_down[it.expert]);
    }
  }, decode, moelab::scheduler_slot({1, D, W, Dout, N}));
  if (any_split) {  // sum the split experts' parts, once per expert, in part order
    const float* pp = parts.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t* to = dst.has_value() ? dst->data_ptr<int64_t>() : nullptr;
    for (const auto& it : items) {
      if (it.part != 0) continue;
      for (int64_t r = it.begin; r < it.begin + it.rows; ++r) {
        float* out = yp + (to != nullptr ? to[r] : r) * Dout;
        std::copy_n(pp + r * Dout, Dout, out);
        for (int64_t p = 1; p < kParts; ++p) {
          const float* part = pp + (p * N + r) * Dout;
          for (int64_t c = 0; c < Dout; ++c) out[c] += part[c];
        }
      }
    }
  }
  return {y, h_all};
}

// Gradients of experts_forward. Sorted mode (no src/dst): `grad` [N, D] is the gradient of y
// and the input gradient comes back per sorted row. Token mode (src, dst and pair_weight, the
// layer's path): y was combined as out[t] = sum_j pair_weight[t·k + j] · y[t·k + j], `grad` is
// d out [T, D] (the combine's dtype), each row's gradient pair_weight[dst[r]] · grad[src[r]] is
// formed in the worker (never materialised for all pairs), and the input gradient comes back
// in pair order [N, D]. Returns (grad rows, grad_w_in, grad_w_down), undefined when not
// wanted; experts with no rows get zero weight gradients.
std::vector<at::Tensor> experts_backward(const at::Tensor& grad, const at::Tensor& x,
                                         const at::Tensor& h_all, const at::Tensor& w_in,
                                         const at::Tensor& w_down, std::vector<int64_t> counts,
                                         int64_t act, c10::optional<at::Tensor> src,
                                         c10::optional<at::Tensor> dst,
                                         c10::optional<at::Tensor> pair_weight, bool need_x,
                                         bool need_w) {
  check_weights(w_in, w_down, counts, act);
  const int64_t E = w_in.size(0), F = w_down.size(1);
  const auto start = offsets(counts);
  const int64_t N = start[E];
  const bool token_mode = pair_weight.has_value();
  TORCH_CHECK(token_mode == (src.has_value() && dst.has_value()),
              "token mode needs src, dst and pair_weight together");
  TORCH_CHECK(grad.is_contiguous(), "grad must be contiguous");
  check_index(src, N, x.size(0), "src");
  check_index(dst, N, N, "dst", true);
  TORCH_CHECK(grad.size(0) == (token_mode ? x.size(0) : N), "grad has ", grad.size(0), " rows");
  at::Tensor gx, gw_in, gw_down;
  if (need_x) gx = at::empty({N, x.size(1)}, x.options());
  if (need_w) {
    gw_in = at::empty_like(w_in);
    gw_down = at::empty_like(w_down);
  }
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    // an idle expert's zero weight gradient is a task too: at decode-sized batches most
    // experts are idle and zero-filling their gradients is most of the work
    if (counts[e] || need_w) items.push_back({e, start[e], counts[e]});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.rows > b.rows; });
  moelab::run_items(items, [&](const Item& it) {
    const int64_t e = it.expert;
    if (it.rows == 0) {
      gw_in[e].zero_();
      gw_down[e].zero_();
      return;
    }
    at::Tensor gy;
    if (token_mode) {
      const auto w = pair_weight->index_select(0, dst->narrow(0, it.begin, it.rows));
      gy = rows_of(grad, src, it.begin, it.rows).mul_(w.unsqueeze(1)).to(x.scalar_type());
    } else {
      gy = grad.narrow(0, it.begin, it.rows);
    }
    const auto h = h_all.narrow(0, it.begin, it.rows);
    const auto ga = at::mm(gy, w_down[e].t());
    at::Tensor gh;
    if (gated(act)) {
      const auto gate = h.narrow(1, 0, F), up = h.narrow(1, F, F);
      const auto s = act_fn(gate, act);
      if (need_w) {
        auto gwd = gw_down[e];
        at::mm_out(gwd, (s * up).t(), gy);
      }
      gh = at::empty({it.rows, 2 * F}, h.options());
      auto gu = gh.narrow(1, F, F);
      at::mul_out(gu, ga, s);
      gh.narrow(1, 0, F).copy_(act_grad(ga.mul_(up), gate, act));
    } else {
      if (need_w) {
        auto gwd = gw_down[e];
        at::mm_out(gwd, act_fn(h, act).t(), gy);
      }
      gh = act_grad(ga, h, act);
    }
    if (need_w) {
      auto gwi = gw_in[e];
      at::mm_out(gwi, rows_of(x, src, it.begin, it.rows).t(), gh);
    }
    if (need_x && token_mode) {
      put_rows(gx, *dst, it.begin, at::mm(gh, w_in[e].t()));
    } else if (need_x) {
      auto gxe = gx.narrow(0, it.begin, it.rows);
      at::mm_out(gxe, gh, w_in[e].t());
    }
  }, /*adaptive=*/false, moelab::scheduler_slot({2}));  // never adaptive: only its counters
  return {gx, gw_in, gw_down};
}

// The operator moelab::fused_moe_pairs: the expert outputs [T·k, D] of an inference forward
// in pair order (y[order[r]] = expert_e(x[token_idx[r]]) for the sorted pairs r), counts the
// int64 [E] pairs per expert.
at::Tensor fused_moe_pairs(const at::Tensor& x, const at::Tensor& w_in, const at::Tensor& w_down,
                           const at::Tensor& counts, int64_t act, const at::Tensor& token_idx,
                           const at::Tensor& order) {
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong && counts.is_cpu(),
              "counts: expected an int64 [E] CPU tensor");
  const auto c = counts.contiguous();
  std::vector<int64_t> per(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  return experts_forward(x.contiguous(), w_in, w_down, std::move(per), act,
                         token_idx.contiguous(), order.contiguous(), order.size(0),
                         /*save_h=*/false, /*max_rows=*/0)[0];
}

// The adaptive scheduler's state (kernel_common.h): calls in each mode over every call shape,
// the cost averages of the latest decode-sized call's shape, the forced solo calls left. And
// a reset of every shape's state that can force solo calls.
std::vector<int64_t> scheduler_stats() {
  const auto& all = moelab::schedulers();
  int64_t parallel = 0, solo = 0;
  for (const auto& st : all.slots) {
    parallel += st.parallel_calls.load();
    solo += st.solo_calls.load();
  }
  const auto& last = all.slots[all.last.load()];
  return {parallel, solo, last.parallel_cost.load(), last.solo_cost.load(),
          all.forced_solo.load()};
}

void scheduler_reset(int64_t solo_calls) {
  TORCH_CHECK(solo_calls >= 0, "solo_calls: ", solo_calls, " < 0");
  moelab::schedulers().reset(solo_calls);
}

// The decode-step kernels as operators of their own: the dispatcher calls them without going
// through Python (a Python custom op cost ~9 us a call, ~1 ms of a SmolLM2-MoE decode step),
// and torch.compile keeps them whole in its graph (their shapes: cpu_kernel.py's fakes).
TORCH_LIBRARY_FRAGMENT(moelab, m) {
  m.def("dense_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "fused_moe_pairs(Tensor x, Tensor w_in, Tensor w_down, Tensor counts, int act, "
      "Tensor token_idx, Tensor order) -> Tensor");
  m.def(
      "quant_rows_mm(Tensor x, Tensor counts, Tensor codes, Tensor scales, Tensor? zeros, "
      "int bits, int out_features, bool int8_activations) -> Tensor");
}

TORCH_LIBRARY_IMPL(moelab, CPU, m) {
  m.impl("dense_rows", &dense_rows);
  m.impl("fused_moe_pairs", &fused_moe_pairs);
  m.impl("quant_rows_mm", &quant_rows_mm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("scheduler_stats", &scheduler_stats);
  m.def("reset_scheduler", &scheduler_reset);
  m.def("experts_forward", &experts_forward);
  m.def("dense_rows_many", &dense_rows_many);
  m.def("experts_backward", &experts_backward);
  m.def("quant_experts_mm", &quant_experts_mm);
  m.def("int8_dot_supported", &moelab::int8_dot_supported);
  moelab::bind_decode_step(m);
}
