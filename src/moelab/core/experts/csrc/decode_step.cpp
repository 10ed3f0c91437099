// The fused decode step (moelab.serve.fused): a whole decode step of a MoETransformer, every
// block of it, in one call from Python.
//
// A compiled decode step (torch.compile) still runs ~20 operator calls per block from a Python
// wrapper; on the 8-bit SmolLM2-MoE at batch 1 the main thread spent about half of a 12 ms
// step outside the kernels (perf: interpreter, dispatcher, allocator). Here the blocks run as
// plain C++ over the same kernels (dense_rows, quant_experts_mm, experts_forward), with the
// small parts (RMSNorm, RoPE, attention over the cache, the router's softmax and top-k) as
// loops over a few thousand floats each. The maths is the model's (models/*.py); the float32
// sums run in another order, so values match the PyTorch path to rounding.
#include "decode_step.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "dense_rows.h"
#include "experts_cpu.h"
#include "kernel_common.h"
#include "quant_cpu.h"

namespace moelab {
namespace {

constexpr int64_t kDenseRows = 8;  // dense_rows' most rows (DENSE_MAX_ROWS); more: at::linear
// attention units (row, head) are split over the threads above this many multiply-adds
// (SmolLM2's 9 heads of 64 at batch 1: 29 positions)
constexpr int64_t kParallelAttention = int64_t{1} << 14;

// Σ a[i]·b[i]: a reduction the compiler may vectorise (omp simd), as ATen's are. Inlined into
// the per-CPU clones of its callers (a clone of its own would cost an indirect call each).
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = w ⊙ x / sqrt(mean(x²) + eps) (models/norm.py), in place allowed.
MOELAB_CLONES void rms_norm(const float* x, const float* w, int64_t D, float eps, float* y) {
  const float r = 1.f / std::sqrt(dot(x, x, D) / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) y[i] = w[i] * (x[i] * r);
}

// One query head q [hd] over keys/values k, v [L, hd] (rows hd apart): positions j < L − 1
// where mask[j], and always the last one (the query's own). out [hd]; s: scratch [L].
MOELAB_CLONES void attend_head(const float* q, const float* k, const float* v, const bool* mask,
                               int64_t L, int64_t hd, float scale, float* s, float* out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < L; ++j) {
    s[j] = (mask[j] || j == L - 1) ? dot(q, k + j * hd, hd) * scale
                                   : -std::numeric_limits<float>::infinity();
    top = std::max(top, s[j]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < L; ++j) total += (s[j] = std::exp(s[j] - top));
  std::fill(out, out + hd, 0.f);
  for (int64_t j = 0; j < L; ++j) {
    if (s[j] == 0.f) continue;
    const float p = s[j] / total;
    const float* vj = v + j * hd;
#pragma omp simd
    for (int64_t i = 0; i < hd; ++i) out[i] += p * vj[i];
  }
}

// log σ(l), finite for every finite l (F.logsigmoid; log of a rounded σ is -inf below -88).
float log_sigmoid(float l) {
  return l >= 0.f ? -std::log1p(std::exp(-l)) : l - std::log1p(std::exp(l));
}

// A contiguous float32 [n] weight.
void check_vector(const at::Tensor& t, int64_t n, const std::string& name) {
  TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == n &&
                  t.is_contiguous(),
              name, ": expected a contiguous float32 [", n, "]");
}

// x [hd] rotated by RoPE's rotate-half convention at the angles of cos/sin [hd] (models/rope.py).
void rope(float* x, const float* c, const float* s, int64_t hd) {
  const int64_t h = hd / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * c[i] - b * s[i];
    x[i + h] = b * c[i + h] + a * s[i + h];
  }
}

// x [n, K] W^T + b for a float32 W [O, K]: the decode kernel for a decode step's rows.
at::Tensor float_rows(const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias) {
  return x.size(0) <= kDenseRows ? dense_rows(x, w, bias) : at::linear(x, w, bias);
}

// A projection's part of an executor's shape: format (32 for float32, else bits) and sizes.
void add_shape(std::vector<int64_t>& shape, const DecodeProj& p) {
  const bool f = p.weight.defined();
  shape.insert(shape.end(), {f ? 32 : p.bits, f ? p.weight.size(0) : p.out_features,
                             f ? p.weight.size(1) : p.codes.size(-1)});
}

// `key` folded with the numbers of `shape` (hash_numbers over both).
int64_t fold_shape(int64_t key, std::vector<int64_t> shape) {
  shape.insert(shape.begin(), key);
  return static_cast<int64_t>(hash_numbers(shape.data(), shape.size()));
}

QuantWeights weights_of(const DecodeProj& p) {
  return {p.codes, p.scales, p.zeros, p.bits, p.out_features};
}

// The projections `ps` of the same rows x [n, K]: one parallel region when all hold float32
// weights (n <= kDenseRows) or all codes of one format (the rows quantized once), else a call
// each.
std::vector<at::Tensor> rows_many(const std::vector<const DecodeProj*>& ps, const at::Tensor& x,
                                  bool int8_activations) {
  const bool dense = x.size(0) <= kDenseRows &&
                     std::all_of(ps.begin(), ps.end(),
                                 [](const DecodeProj* p) { return p->weight.defined(); });
  if (dense) {
    std::vector<at::Tensor> ws;
    std::vector<c10::optional<at::Tensor>> biases;
    for (const auto* p : ps) {
      ws.push_back(p->weight);
      biases.push_back(p->bias);
    }
    return dense_rows_many(x, ws, biases);
  }
  const bool together = std::all_of(ps.begin(), ps.end(), [&](const DecodeProj* p) {
    return !p->weight.defined() && p->bits == ps[0]->bits &&
           p->scales.size(-1) == ps[0]->scales.size(-1);
  });
  std::vector<at::Tensor> ys;
  if (!together) {
    for (const auto* p : ps) ys.push_back(p->rows(x, int8_activations));
    return ys;
  }
  std::vector<int64_t> tiles, experts;
  const int64_t n = x.size(0);
  expert_tiles(&n, 1, tiles, experts);  // a dense projection: every row through expert 0
  std::vector<QuantWeights> ws;
  for (const auto* p : ps) ws.push_back(weights_of(*p));
  ys = quant_experts_mm_many(x, tiles, experts, ws, int8_activations);
  for (size_t i = 0; i < ps.size(); ++i)
    if (ps[i]->bias.has_value()) ys[i].add_(*ps[i]->bias);
  return ys;
}

}  // namespace

at::Tensor DecodeProj::rows(const at::Tensor& x, bool int8_activations) const {
  return weight.defined() ? float_rows(x, weight, bias) : rows_many({this}, x, int8_activations)[0];
}

namespace {

DecodeProj check_proj(DecodeProj p, const std::string& name) {
  if (p.weight.defined()) {
    TORCH_CHECK(p.weight.scalar_type() == at::kFloat && p.weight.dim() == 2 &&
                    p.weight.is_contiguous(),
                name, ": expected a contiguous float32 [O, K] weight");
  } else {
    TORCH_CHECK(p.codes.defined() && p.scales.defined() && (p.bits == 4 || p.bits == 8),
                name, ": expected float32 weights or 4/8-bit codes");
  }
  return p;
}

}  // namespace

void DecodeExecutor::add_block(DecodeBlock block) {
  const std::string at = "block " + std::to_string(blocks_.size());
  TORCH_CHECK(embed_.defined(), at, ": set the head first (it gives the model width)");
  const int64_t D = embed_.size(1);
  for (auto* p : {&block.q, &block.k, &block.v, &block.o}) *p = check_proj(*p, at);
  TORCH_CHECK(block.n_heads > 0 && block.n_kv_heads > 0 && block.n_heads % block.n_kv_heads == 0,
              at, ": n_kv_heads must divide n_heads");
  TORCH_CHECK(block.head_dim > 0 && block.head_dim % 2 == 0, at, ": head_dim must be even");
  check_vector(block.attn_norm, D, at + " attn_norm");
  check_vector(block.ffn_norm, D, at + " ffn_norm");
  if (block.qk_norm != DecodeBlock::kQKNormNone) {
    const bool full = block.qk_norm == DecodeBlock::kQKNormFull;
    TORCH_CHECK(full || block.qk_norm == DecodeBlock::kQKNormHead, at, ": unknown qk_norm");
    check_vector(block.q_norm, block.head_dim * (full ? block.n_heads : 1), at + " q_norm");
    check_vector(block.k_norm, block.head_dim * (full ? block.n_kv_heads : 1), at + " k_norm");
  }
  if (block.kind == DecodeBlock::kMoE) {
    TORCH_CHECK(block.router.scalar_type() == at::kFloat && block.router.is_contiguous() &&
                    block.router.dim() == 2 && block.router.size(1) == D && block.top_k >= 1 &&
                    block.top_k <= block.router.size(0),
                at, ": expected a contiguous float32 router [E, ", D, "] and 1 <= top_k <= E");
    TORCH_CHECK(block.score_func == DecodeBlock::kSoftmax ||
                    block.score_func == DecodeBlock::kSigmoid,
                at, ": unknown score_func");
    if (block.expert_bias.defined())
      check_vector(block.expert_bias, block.router.size(0), at + " expert_bias");
    if (block.w_in.defined()) {
      TORCH_CHECK(block.w_in.dim() == 3 && block.w_down.dim() == 3 &&
                      block.w_in.size(0) == block.router.size(0) && block.w_in.size(1) == D,
                  at, ": expected expert weights [E, ", D, ", W] and [E, F, ", D, "]");
    } else {
      for (auto* p : {&block.gate, &block.up, &block.down}) *p = check_proj(*p, at);
      TORCH_CHECK(block.act == 0, at, ": quantized experts: swiglu only");
    }
  } else {
    for (auto* p : {&block.gate, &block.up, &block.down}) *p = check_proj(*p, at);
  }
  std::vector<int64_t> shape = {block.kind, block.n_heads, block.n_kv_heads, block.head_dim,
                                block.qk_norm};
  for (const auto* p : {&block.q, &block.k, &block.v, &block.o, &block.gate, &block.up,
                        &block.down})
    if (p->weight.defined() || p->codes.defined()) add_shape(shape, *p);
  if (block.kind == DecodeBlock::kMoE) {
    shape.insert(shape.end(), {block.router.size(0), block.top_k, block.act});
    if (block.w_in.defined()) shape.insert(shape.end(), {block.w_in.size(2), block.w_down.size(1)});
  }
  shape_key_ = fold_shape(shape_key_, std::move(shape));
  blocks_.push_back(std::move(block));
}

void DecodeExecutor::set_head(at::Tensor embed, at::Tensor norm, double norm_eps,
                              DecodeProj head, double logit_scale) {
  TORCH_CHECK(embed.scalar_type() == at::kFloat && embed.dim() == 2 && embed.is_contiguous(),
              "embed: expected a contiguous float32 [V, D]");
  TORCH_CHECK(blocks_.empty(), "set_head: before the blocks");
  check_vector(norm, embed.size(1), "norm");
  embed_ = std::move(embed);
  norm_ = std::move(norm);
  norm_eps_ = norm_eps;
  head_ = check_proj(std::move(head), "head");
  logit_scale_ = logit_scale;
  std::vector<int64_t> shape = {embed_.size(0), embed_.size(1), int8_activations_};
  add_shape(shape, head_);
  shape_key_ = fold_shape(0, std::move(shape));
}

// Attention of the new rows over their cached positions (models/attention.py): row b's query
// heads see every position j <= pos[b] with key_mask[row, j] set, and always pos[b] itself.
void DecodeExecutor::attend(const DecodeBlock& blk, const at::Tensor& q, const at::Tensor& kc,
                            const at::Tensor& vc, const at::Tensor& key_mask,
                            const std::vector<int64_t>& pos, int64_t row0,
                            at::Tensor& out) const {
  const int64_t n = q.size(0), H = blk.n_heads, hd = blk.head_dim;
  const int64_t rep = blk.n_heads / blk.n_kv_heads, cap = kc.size(2);
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const bool* mp = key_mask.data_ptr<bool>();
  const int64_t mstride = key_mask.stride(0);
  float* op = out.data_ptr<float>();
  int64_t longest = 0;
  for (const int64_t p : pos) longest = std::max(longest, p + 1);
  const int64_t units = n * H;
  // units lo .. hi-1 in turn, with one scratch row of scores (uninitialised) for them all
  const auto units_of = [&](int64_t lo, int64_t hi) {
    std::unique_ptr<float[]> scores(new float[longest]);
    for (int64_t u = lo; u < hi; ++u) {
      const int64_t b = u / H, h = u % H, row = row0 + b;
      const int64_t kv = (row * blk.n_kv_heads + h / rep) * cap * hd;
      attend_head(qp + (b * H + h) * hd, kp + kv, vp + kv, mp + row * mstride, pos[b] + 1, hd,
                  scale, scores.get(), op + (b * H + h) * hd);
    }
  };
  if (units > 1 && units * longest * hd > kParallelAttention && thread_mode() != Mode::kSolo) {
    at::parallel_for(0, units, 1, units_of);
  } else {
    units_of(0, units);
  }
}

// The block's attention sublayer on the normed rows xn [n, D]; returns [n, D].
at::Tensor DecodeExecutor::attention(const DecodeBlock& blk, const at::Tensor& xn,
                                     const at::Tensor& kc, const at::Tensor& vc,
                                     const at::Tensor& key_mask, const std::vector<int64_t>& pos,
                                     int64_t row0, const at::Tensor& cos,
                                     const at::Tensor& sin) const {
  const int64_t n = xn.size(0), H = blk.n_heads, Hkv = blk.n_kv_heads, hd = blk.head_dim;
  auto qkv = rows_many({&blk.q, &blk.k, &blk.v}, xn, int8_activations_);
  auto q = qkv[0].contiguous(), k = qkv[1].contiguous(), v = qkv[2].contiguous();
  TORCH_CHECK(q.size(1) == H * hd && k.size(1) == Hkv * hd && v.size(1) == Hkv * hd,
              "attention: projection widths do not match the heads");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float eps = static_cast<float>(blk.norm_eps);
  for (int64_t b = 0; b < n; ++b) {
    if (blk.qk_norm == DecodeBlock::kQKNormFull) {
      rms_norm(qp + b * H * hd, blk.q_norm.data_ptr<float>(), H * hd, eps, qp + b * H * hd);
      rms_norm(kp + b * Hkv * hd, blk.k_norm.data_ptr<float>(), Hkv * hd, eps, kp + b * Hkv * hd);
    } else if (blk.qk_norm == DecodeBlock::kQKNormHead) {
      for (int64_t h = 0; h < H; ++h)
        rms_norm(qp + (b * H + h) * hd, blk.q_norm.data_ptr<float>(), hd, eps,
                 qp + (b * H + h) * hd);
      for (int64_t h = 0; h < Hkv; ++h)
        rms_norm(kp + (b * Hkv + h) * hd, blk.k_norm.data_ptr<float>(), hd, eps,
                 kp + (b * Hkv + h) * hd);
    }
    const float* c = cos.data_ptr<float>() + pos[b] * hd;
    const float* s = sin.data_ptr<float>() + pos[b] * hd;
    for (int64_t h = 0; h < H; ++h) rope(qp + (b * H + h) * hd, c, s, hd);
    for (int64_t h = 0; h < Hkv; ++h) rope(kp + (b * Hkv + h) * hd, c, s, hd);
    // the cache row's keys/values at this position, [Hkv, hd] strided by the capacity
    const int64_t cap = kc.size(2);
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t at_pos = (((row0 + b) * Hkv + h) * cap + pos[b]) * hd;
      std::copy_n(kp + (b * Hkv + h) * hd, hd, kc.data_ptr<float>() + at_pos);
      std::copy_n(v.data_ptr<float>() + (b * Hkv + h) * hd, hd, vc.data_ptr<float>() + at_pos);
    }
  }
  auto heads = at::empty({n, H * hd}, xn.options());
  attend(blk, q, kc, vc, key_mask, pos, row0, heads);
  return blk.o.rows(heads, int8_activations_);
}

// Router (core/routers: token choice) of the normed rows xn [n, D]: fills idx, w [n, k] with
// each row's experts in descending selection order and their combine weights.
void DecodeExecutor::route(const DecodeBlock& blk, const at::Tensor& xn, std::vector<int64_t>& idx,
                           std::vector<float>& w) const {
  const int64_t n = xn.size(0), E = blk.router.size(0), k = blk.top_k;
  const auto logits = float_rows(xn, blk.router, c10::nullopt).contiguous();
  const float* lp = logits.data_ptr<float>();
  const float* bias = blk.expert_bias.defined() ? blk.expert_bias.data_ptr<float>() : nullptr;
  idx.assign(n * k, 0);
  w.assign(n * k, 0.f);
  std::vector<float> score(E), sel(E);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < n; ++t) {
    const float* l = lp + t * E;
    const float top = *std::max_element(l, l + E);
    float total = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      if (blk.score_func == DecodeBlock::kSoftmax) {
        total += (score[e] = std::exp(l[e] - top));
      } else {
        score[e] = 1.f / (1.f + std::exp(-l[e]));
      }
    }
    if (blk.score_func == DecodeBlock::kSoftmax)
      for (int64_t e = 0; e < E; ++e) score[e] /= total;
    const bool on_logits = blk.score_func == DecodeBlock::kSoftmax && !blk.softmax_before_topk;
    for (int64_t e = 0; e < E; ++e) sel[e] = (on_logits ? l[e] : score[e]) + (bias ? bias[e] : 0.f);
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    // the k largest, ties to the lower index (a stable partial sort)
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return sel[a] > sel[b] || (sel[a] == sel[b] && a < b); });
    int64_t* it = idx.data() + t * k;
    float* wt = w.data() + t * k;
    std::copy_n(order.begin(), k, it);
    if (on_logits || blk.norm_topk_prob) {
      // a softmax over the selected logits (softmax scores), or over the selected log
      // scores, i.e. s_i / Σ_sel s_j (scores.selected_weights)
      float m = -std::numeric_limits<float>::infinity(), z = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const float v = blk.score_func == DecodeBlock::kSoftmax ? l[it[j]] : log_sigmoid(l[it[j]]);
        wt[j] = v;
        m = std::max(m, v);
      }
      for (int64_t j = 0; j < k; ++j) z += (wt[j] = std::exp(wt[j] - m));
      for (int64_t j = 0; j < k; ++j) wt[j] /= z;
    } else {
      for (int64_t j = 0; j < k; ++j) wt[j] = score[it[j]];
    }
    if (blk.routed_scaling_factor != 1.0)
      for (int64_t j = 0; j < k; ++j) wt[j] *= static_cast<float>(blk.routed_scaling_factor);
  }
}

// The block's MoE sublayer on xn [n, D], added into x [n, D]; the chosen experts [n, k] go to
// `chosen`.
void DecodeExecutor::moe(const DecodeBlock& blk, const at::Tensor& xn, at::Tensor& x,
                         at::Tensor& chosen) const {
  const int64_t n = xn.size(0), E = blk.router.size(0), k = blk.top_k, N = n * k;
  std::vector<int64_t> idx;
  std::vector<float> w;
  route(blk, xn, idx, w);
  std::copy(idx.begin(), idx.end(), chosen.data_ptr<int64_t>());
  // pairs sorted by expert, stable (the dispatcher's order): token and pair index of each
  std::vector<int64_t> counts(E, 0);
  for (const int64_t e : idx) ++counts[e];
  auto token_idx = at::empty({N}, at::kLong);
  auto pair_of = at::empty({N}, at::kLong);
  int64_t* tp = token_idx.data_ptr<int64_t>();
  int64_t* pp = pair_of.data_ptr<int64_t>();
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 1; e < E; ++e) next[e] = next[e - 1] + counts[e - 1];
  for (int64_t p = 0; p < N; ++p) {
    const int64_t r = next[idx[p]]++;
    tp[r] = p / k;
    pp[r] = p;
  }
  at::Tensor y_pairs;  // [N, D], pair order
  if (blk.w_in.defined()) {
    y_pairs = experts_forward(xn, blk.w_in, blk.w_down, counts, blk.act, token_idx, pair_of, N,
                              /*save_h=*/false, /*max_rows=*/0)[0];
  } else {
    std::vector<int64_t> tiles, experts;
    expert_tiles(counts.data(), E, tiles, experts);
    const auto xs = xn.index_select(0, token_idx);
    auto gate_up = quant_experts_mm_many(
        xs, tiles, experts, {weights_of(blk.gate), weights_of(blk.up)}, int8_activations_);
    auto a = at::silu_(gate_up[0]).mul_(gate_up[1]);
    const auto y =
        quant_experts_mm_many(a, tiles, experts, {weights_of(blk.down)}, int8_activations_)[0];
    y_pairs = at::empty_like(y);
    y_pairs.index_copy_(0, pair_of, y);
  }
  const int64_t D = x.size(1);
  const float* yp = y_pairs.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  std::vector<float> acc(D);
  for (int64_t t = 0; t < n; ++t) {
    float* xt = xp + t * D;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < k; ++j) {
      const float wj = w[t * k + j];
      const float* yj = yp + (t * k + j) * D;
      for (int64_t i = 0; i < D; ++i) acc[i] += wj * yj[i];
    }
    for (int64_t i = 0; i < D; ++i) xt[i] += acc[i];
  }
}

// A step makes ~5 kernel calls per block, microseconds to a millisecond each. Chosen call by
// call (kernel_common.h), a solo call let the worker threads fall asleep, and their wake-up
// counted against the next call's parallel mode; on a host whose memory bandwidth comes and
// goes with other tenants' load, the small calls' averages also flipped with it. On
// SmolLM2-MoE at batch 1 that left most calls solo, and the step was 3 % slower than with one
// mode per step on an idle host and 16 % slower with a busy-loop process on one of the two
// cores (scratch measurement, interleaved, 6-10 repeats). So a step runs all its calls in one
// mode, chosen as a kernel call chooses its own, on the steps' wall times per row, in a
// scheduler state keyed by the executor's shape (sizes, weight formats, routing) and the row
// count: process-wide, as the calls' states are, so that an engine made per request does not
// start with the warm-up's solo steps again. ATen's own operators in a step (at::linear past
// kDenseRows rows, index_select, silu) keep ATen's threads.
std::tuple<at::Tensor, std::vector<at::Tensor>> DecodeExecutor::step(
    const std::vector<int64_t>& ids, const std::vector<int64_t>& pos,
    const std::vector<at::Tensor>& k_cache, const std::vector<at::Tensor>& v_cache,
    const at::Tensor& key_mask, int64_t row0, const at::Tensor& cos,
    const at::Tensor& sin) const {
  check_step(ids, pos, k_cache, v_cache, key_mask, row0, cos, sin);
  const int64_t n = static_cast<int64_t>(ids.size());
  SchedulerState& st = schedulers().steps[scheduler_slot({shape_key_, n})];
  const bool threads = at::get_num_threads() > 1;
  const ModeChoice mode = threads ? st.choose() : ModeChoice{true, 0, false};
  const int64_t start = now_ns();
  std::tuple<at::Tensor, std::vector<at::Tensor>> out;
  try {
    ModeScope scope(mode.solo ? Mode::kSolo : Mode::kParallel);
    out = run(ids, pos, k_cache, v_cache, key_mask, row0, cos, sin);
  } catch (...) {
    // no sample, but a probe run that ends here must still schedule the next one
    if (threads) st.record({mode.solo, 0, mode.last_probe}, 0);
    throw;
  }
  if (threads) st.record(mode, (now_ns() - start) / n);
  ++(mode.solo ? solo_steps_ : parallel_steps_);
  return out;
}

std::tuple<int64_t, int64_t> DecodeExecutor::mode_steps() const {
  return {parallel_steps_.load(), solo_steps_.load()};
}

// Every input of a step checked before anything is written (a refused step changes no cache).
void DecodeExecutor::check_step(const std::vector<int64_t>& ids, const std::vector<int64_t>& pos,
                                const std::vector<at::Tensor>& k_cache,
                                const std::vector<at::Tensor>& v_cache,
                                const at::Tensor& key_mask, int64_t row0, const at::Tensor& cos,
                                const at::Tensor& sin) const {
  const int64_t n = static_cast<int64_t>(ids.size());
  TORCH_CHECK(embed_.defined(), "decode step: no head set");
  TORCH_CHECK(n >= 1 && static_cast<int64_t>(pos.size()) == n, "decode step: ", n,
              " ids and ", pos.size(), " positions");
  TORCH_CHECK(k_cache.size() == blocks_.size() && v_cache.size() == blocks_.size(),
              "decode step: one key and one value cache per block");
  TORCH_CHECK(key_mask.scalar_type() == at::kBool && key_mask.dim() == 2 &&
                  key_mask.stride(1) == 1 && row0 >= 0 && row0 + n <= key_mask.size(0),
              "decode step: key_mask must be bool [rows, capacity] with unit column stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.dim() == 2 && sin.sizes() == cos.sizes(),
              "decode step: cos/sin must be contiguous float32 [positions, head_dim]");
  for (const auto& blk : blocks_)
    TORCH_CHECK(cos.size(1) == blk.head_dim, "decode step: cos/sin of ", cos.size(1),
                " dims, the blocks' heads ", blk.head_dim);
  const int64_t V = embed_.size(0);
  for (int64_t b = 0; b < n; ++b) {
    TORCH_CHECK(ids[b] >= 0 && ids[b] < V, "input_ids: ", ids[b], " outside [0, ", V, ")");
    TORCH_CHECK(pos[b] >= 0 && pos[b] < key_mask.size(1) && pos[b] < cos.size(0),
                "decode step: position ", pos[b], " outside the cache");
  }
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const DecodeBlock& blk = blocks_[l];
    const auto& kc = k_cache[l];
    const auto& vc = v_cache[l];
    TORCH_CHECK(kc.scalar_type() == at::kFloat && kc.is_contiguous() && vc.is_contiguous() &&
                    kc.sizes() == vc.sizes() && kc.dim() == 4 && kc.size(1) == blk.n_kv_heads &&
                    kc.size(3) == blk.head_dim && kc.size(0) >= row0 + n &&
                    kc.size(2) >= key_mask.size(1),
                "decode step: block ", l, "'s cache must be contiguous float32 [rows, ",
                blk.n_kv_heads, ", capacity, ", blk.head_dim, "]");
  }
}

std::tuple<at::Tensor, std::vector<at::Tensor>> DecodeExecutor::run(
    const std::vector<int64_t>& ids, const std::vector<int64_t>& pos,
    const std::vector<at::Tensor>& k_cache, const std::vector<at::Tensor>& v_cache,
    const at::Tensor& key_mask, int64_t row0, const at::Tensor& cos,
    const at::Tensor& sin) const {
  // no autograd graph: the weights are parameters (the returned tensors are plain ones)
  at::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t D = embed_.size(1);
  auto x = at::empty({n, D}, embed_.options());
  for (int64_t b = 0; b < n; ++b)
    std::copy_n(embed_.data_ptr<float>() + ids[b] * D, D, x.data_ptr<float>() + b * D);
  auto xn = at::empty_like(x);
  std::vector<at::Tensor> chosen;
  const auto norm_rows = [&](const at::Tensor& weight, double eps) {
    for (int64_t b = 0; b < n; ++b)
      rms_norm(x.data_ptr<float>() + b * D, weight.data_ptr<float>(), D, static_cast<float>(eps),
               xn.data_ptr<float>() + b * D);
  };
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const DecodeBlock& blk = blocks_[l];
    const auto& kc = k_cache[l];
    const auto& vc = v_cache[l];
    norm_rows(blk.attn_norm, blk.norm_eps);
    x.add_(attention(blk, xn, kc, vc, key_mask, pos, row0, cos, sin));
    norm_rows(blk.ffn_norm, blk.norm_eps);
    if (blk.kind == DecodeBlock::kMoE) {
      chosen.push_back(at::empty({n, blk.top_k}, at::kLong));
      moe(blk, xn, x, chosen.back());
    } else {
      auto gate_up = rows_many({&blk.gate, &blk.up}, xn, int8_activations_);
      x.add_(blk.down.rows(at::silu_(gate_up[0]).mul_(gate_up[1]), int8_activations_));
    }
  }
  norm_rows(norm_, norm_eps_);
  auto logits = head_.rows(xn, int8_activations_);
  if (logit_scale_ != 1.0) logits.mul_(logit_scale_);
  return {logits, chosen};
}

}  // namespace moelab

namespace moelab {

void bind_decode_step(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeProj>(m, "DecodeProj")
      .def(py::init<>())
      .def_readwrite("weight", &DecodeProj::weight)
      .def_readwrite("codes", &DecodeProj::codes)
      .def_readwrite("scales", &DecodeProj::scales)
      .def_readwrite("zeros", &DecodeProj::zeros)
      .def_readwrite("bias", &DecodeProj::bias)
      .def_readwrite("bits", &DecodeProj::bits)
      .def_readwrite("out_features", &DecodeProj::out_features);
  py::class_<DecodeBlock>(m, "DecodeBlock")
      .def(py::init<>())
      .def_readwrite("kind", &DecodeBlock::kind)
      .def_readwrite("attn_norm", &DecodeBlock::attn_norm)
      .def_readwrite("ffn_norm", &DecodeBlock::ffn_norm)
      .def_readwrite("norm_eps", &DecodeBlock::norm_eps)
      .def_readwrite("q", &DecodeBlock::q)
      .def_readwrite("k", &DecodeBlock::k)
      .def_readwrite("v", &DecodeBlock::v)
      .def_readwrite("o", &DecodeBlock::o)
      .def_readwrite("n_heads", &DecodeBlock::n_heads)
      .def_readwrite("n_kv_heads", &DecodeBlock::n_kv_heads)
      .def_readwrite("head_dim", &DecodeBlock::head_dim)
      .def_readwrite("qk_norm", &DecodeBlock::qk_norm)
      .def_readwrite("q_norm", &DecodeBlock::q_norm)
      .def_readwrite("k_norm", &DecodeBlock::k_norm)
      .def_readwrite("gate", &DecodeBlock::gate)
      .def_readwrite("up", &DecodeBlock::up)
      .def_readwrite("down", &DecodeBlock::down)
      .def_readwrite("router", &DecodeBlock::router)
      .def_readwrite("expert_bias", &DecodeBlock::expert_bias)
      .def_readwrite("top_k", &DecodeBlock::top_k)
      .def_readwrite("score_func", &DecodeBlock::score_func)
      .def_readwrite("softmax_before_topk", &DecodeBlock::softmax_before_topk)
      .def_readwrite("norm_topk_prob", &DecodeBlock::norm_topk_prob)
      .def_readwrite("routed_scaling_factor", &DecodeBlock::routed_scaling_factor)
      .def_readwrite("w_in", &DecodeBlock::w_in)
      .def_readwrite("w_down", &DecodeBlock::w_down)
      .def_readwrite("act", &DecodeBlock::act);
  py::class_<DecodeExecutor>(m, "DecodeExecutor")
      .def(py::init<bool>())
      .def("add_block", &DecodeExecutor::add_block)
      .def("set_head", &DecodeExecutor::set_head)
      // other Python threads (the HTTP server) run while a step computes
      .def("step", &DecodeExecutor::step, py::call_guard<py::gil_scoped_release>())
      .def("mode_steps", &DecodeExecutor::mode_steps);
}

}  // namespace moelab
