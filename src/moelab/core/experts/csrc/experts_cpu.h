// The fused expert kernel's forward (experts_cpu.cpp), for the decode executor.
#pragma once

#include <ATen/ATen.h>

#include <vector>

// Expert outputs [n_out, Dout] of rows sorted by expert (`counts` per expert, in order): row r
// reads x[src[r]] (x's row r without src) and is written to dst[r] (row r without dst).
// act: cpu_kernel.ACTIVATIONS. Returns {y, h} (h only with save_h).
std::vector<at::Tensor> experts_forward(const at::Tensor& x, const at::Tensor& w_in,
                                        const at::Tensor& w_down, std::vector<int64_t> counts,
                                        int64_t act, c10::optional<at::Tensor> src,
                                        c10::optional<at::Tensor> dst, int64_t n_out,
                                        bool save_h, int64_t max_rows);
