// The decode-sized dense projection (dense_rows.cpp), registered in experts_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

#include <vector>

// The operator moelab::dense_rows: x [..., K] (at most 8 rows) -> [..., N], blocks of output
// features sized for the intra-op threads.
at::Tensor dense_rows(const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias);

// y_j [M, N_j] = x [M <= 8, K] · w_jᵀ (+ bias_j) for several weights of the same rows, every
// block of output features of all of them one parallel region (q/k/v, gate/up).
std::vector<at::Tensor> dense_rows_many(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                                        const std::vector<c10::optional<at::Tensor>>& biases);
