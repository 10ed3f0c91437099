// The decode-sized dense projection (dense_rows.cpp), registered in experts_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

// The operator moelab::dense_rows: x [..., K] (at most 8 rows) -> [..., N], blocks of output
// features sized for the intra-op threads.
at::Tensor dense_rows(const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias);
