// The quantized decode kernel (quant_cpu.cpp), bound and registered in experts_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

#include <vector>

at::Tensor quant_experts_mm(const at::Tensor& x, const std::vector<int64_t>& counts,
                            const std::vector<int64_t>& experts, const at::Tensor& codes,
                            const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                            int64_t bits, int64_t out_features, bool int8_activations);

// counts[e] rows of each of the E experts, in order (zeros allowed), as the tiles of at most
// the kernel's row count that quant_experts_mm takes (appended to tiles and experts).
void expert_tiles(const int64_t* counts, int64_t E, std::vector<int64_t>& tiles,
                  std::vector<int64_t>& experts);

// One quantized projection's weights (see quant_experts_mm).
struct QuantWeights {
  at::Tensor codes, scales;
  c10::optional<at::Tensor> zeros;
  int64_t bits, out_features;
};

// quant_experts_mm of several projections of the same rows in one parallel region, the rows
// quantized once: projections that share bits, groups and expert count (q/k/v, gate/up).
std::vector<at::Tensor> quant_experts_mm_many(const at::Tensor& x,
                                              const std::vector<int64_t>& counts,
                                              const std::vector<int64_t>& experts,
                                              const std::vector<QuantWeights>& projections,
                                              bool int8_activations);

at::Tensor quant_rows_mm(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& codes,
                         const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                         int64_t bits, int64_t out_features, bool int8_activations);
