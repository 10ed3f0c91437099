// The quantized decode kernel (quant_cpu.cpp), bound and registered in experts_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

#include <vector>

at::Tensor quant_experts_mm(const at::Tensor& x, const std::vector<int64_t>& counts,
                            const std::vector<int64_t>& experts, const at::Tensor& codes,
                            const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                            int64_t bits, int64_t out_features, bool int8_activations);

at::Tensor quant_rows_mm(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& codes,
                         const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                         int64_t bits, int64_t out_features, bool int8_activations);
