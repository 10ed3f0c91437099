// The fused decode step (decode_step.cpp): a MoETransformer's blocks as plain structs, built
// once from Python (moelab/serve/fused.py) and run a whole decode step per call.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <tuple>
#include <vector>

namespace moelab {

// One projection y = x Wᵀ + b: float32 W [O, K] (`weight`), or packed 4/8-bit codes of E
// experts with float16 scales [E, O, G] and optional zeros (the quantized formats the
// quant_rows_mm kernel reads; a dense projection is one expert).
struct DecodeProj {
  at::Tensor weight;
  at::Tensor codes, scales;
  c10::optional<at::Tensor> zeros, bias;
  int64_t bits = 0, out_features = 0;

  // x [n, K] float32 contiguous -> [n, O] (every row through expert 0 for codes).
  at::Tensor rows(const at::Tensor& x, bool int8_activations) const;
};

// One pre-norm decoder block (models/block.py) with a dense SwiGLU FFN or a token-choice MoE.
struct DecodeBlock {
  enum Kind : int64_t { kDense = 0, kMoE = 1 };
  enum QKNorm : int64_t { kQKNormNone = 0, kQKNormHead = 1, kQKNormFull = 2 };
  enum ScoreFunc : int64_t { kSoftmax = 0, kSigmoid = 1 };

  int64_t kind = kDense;
  at::Tensor attn_norm, ffn_norm;  // [D]
  double norm_eps = 1e-5;          // every RMSNorm of the block
  DecodeProj q, k, v, o;
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int64_t qk_norm = kQKNormNone;
  at::Tensor q_norm, k_norm;
  // dense FFN (kDense), or quantized experts of the MoE (kMoE without w_in)
  DecodeProj gate, up, down;
  // MoE: router weight [E, D], optional expert bias [E] (selection only), routing rule
  at::Tensor router, expert_bias;
  int64_t top_k = 1, score_func = kSoftmax;
  bool softmax_before_topk = true, norm_topk_prob = false;
  double routed_scaling_factor = 1.0;
  // float32 experts in the bank layout [E, D, W] / [E, F, D], activation (ACTIVATIONS)
  at::Tensor w_in, w_down;
  int64_t act = 0;
};

class DecodeExecutor {
 public:
  explicit DecodeExecutor(bool int8_activations) : int8_activations_(int8_activations) {}

  void add_block(DecodeBlock block);
  // the embedding [V, D], the final RMSNorm's weight [D] and eps, the LM head; first
  void set_head(at::Tensor embed, at::Tensor norm, double norm_eps, DecodeProj head,
                double logit_scale);

  // One decode step of rows row0 .. row0+n-1 of the caches: token ids[b] at position pos[b]
  // (its keys/values are written there). Returns logits [n, V] and, per MoE block, the
  // chosen experts [n, k]. Every call of moelab's kernels in a step runs in one mode,
  // parallel or on the calling thread alone, chosen per step (decode_step.cpp).
  std::tuple<at::Tensor, std::vector<at::Tensor>> step(
      const std::vector<int64_t>& ids, const std::vector<int64_t>& pos,
      const std::vector<at::Tensor>& k_cache, const std::vector<at::Tensor>& v_cache,
      const at::Tensor& key_mask, int64_t row0, const at::Tensor& cos,
      const at::Tensor& sin) const;

  // This executor's steps so far in parallel and solo.
  std::tuple<int64_t, int64_t> mode_steps() const;

 private:
  void check_step(const std::vector<int64_t>& ids, const std::vector<int64_t>& pos,
                  const std::vector<at::Tensor>& k_cache, const std::vector<at::Tensor>& v_cache,
                  const at::Tensor& key_mask, int64_t row0, const at::Tensor& cos,
                  const at::Tensor& sin) const;
  std::tuple<at::Tensor, std::vector<at::Tensor>> run(
      const std::vector<int64_t>& ids, const std::vector<int64_t>& pos,
      const std::vector<at::Tensor>& k_cache, const std::vector<at::Tensor>& v_cache,
      const at::Tensor& key_mask, int64_t row0, const at::Tensor& cos,
      const at::Tensor& sin) const;
  at::Tensor attention(const DecodeBlock& blk, const at::Tensor& xn, const at::Tensor& kc,
                       const at::Tensor& vc, const at::Tensor& key_mask,
                       const std::vector<int64_t>& pos, int64_t row0, const at::Tensor& cos,
                       const at::Tensor& sin) const;
  void attend(const DecodeBlock& blk, const at::Tensor& q, const at::Tensor& kc,
              const at::Tensor& vc, const at::Tensor& key_mask, const std::vector<int64_t>& pos,
              int64_t row0, at::Tensor& out) const;
  void route(const DecodeBlock& blk, const at::Tensor& xn, std::vector<int64_t>& idx,
             std::vector<float>& w) const;
  void moe(const DecodeBlock& blk, const at::Tensor& xn, at::Tensor& x, at::Tensor& chosen) const;

  bool int8_activations_;
  std::vector<DecodeBlock> blocks_;
  at::Tensor embed_, norm_;
  double norm_eps_ = 1e-5, logit_scale_ = 1.0;
  DecodeProj head_;
  // a hash of what sets a step's cost apart (sizes, weight formats, routing): with the row
  // count, the key of its mode's scheduler state
  int64_t shape_key_ = 0;
  mutable std::atomic<int64_t> parallel_steps_{0}, solo_steps_{0};
};

// The Python bindings (DecodeProj, DecodeBlock, DecodeExecutor), called by the module's
// PYBIND11_MODULE in experts_cpu.cpp.
void bind_decode_step(pybind11::module& m);

}  // namespace moelab
