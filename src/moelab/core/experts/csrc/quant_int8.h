// Integer dot products for the quantized decode kernel (quant_int8.cpp), used by quant_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace moelab {

// Whether this CPU runs the integer path (AVX-512 with VNNI).
bool int8_dot_supported();

// The rows x [N, K] (float32) quantized per weight group of `group` columns, the way the
// integer kernel reads them (see quant_int8.cpp): q int8 [N, K] (at 4 bits each 64-column
// chunk reordered to its 32 even columns, then its 32 odd ones: the low and high nibbles of
// the chunk's 32 code bytes), d float32 [N, G] (the group's step, max|x|/127) and qsum int32
// [N, G] (Σ q over the group).
void quantize_rows_int8(const float* x, int64_t N, int64_t K, int64_t group, int64_t bits,
                        int8_t* q, float* d, int32_t* qsum);

// out[m, o] for m < M, o in [o0, o1) = Σ_g s[o,g]·d[m,g]·(Σ_{j∈g} c[o,j]·q[m,j] − z[o,g]·qsum[m,g])
// with one expert's packed codes c (8 or 4 bits, groups of a multiple of 64 columns), scales
// s float16 [O, G] and zeros z uint8 [O, G] (nullptr: symmetric, 2^(bits−1)).
void quant_rows_int8(int64_t M, const int8_t* q, const float* d, const int32_t* qsum, int64_t K,
                     const uint8_t* codes, const at::Half* scales, const uint8_t* zeros,
                     int64_t G, int64_t bits, int64_t o0, int64_t o1, float* out, int64_t ldo);

}  // namespace moelab
