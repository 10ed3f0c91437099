// The decode-sized dense projection (dense_rows.cpp), bound in experts_cpu.cpp's module.
#pragma once

#include <ATen/ATen.h>

at::Tensor dense_rows_mm(const at::Tensor& x, const at::Tensor& w,
                         const c10::optional<at::Tensor>& bias, int64_t block);
