// Quantized experts at decode with integer dot products: each input row is quantized per
// weight group to int8 (step d = max|x|/127, q = round(x/d), llama.cpp's Q8 activations:
// `quantize_row_q8_0_ref` in ggml-quants.c, here per weight group instead of per 32), and each
// group's Σ c·q runs on AVX-512 VNNI (`vpdpbusd`: 64 unsigned code × signed activation
// products per instruction, summed into 16 int32 lanes). The zero point enters exactly, as
// −z·Σq in the integer lanes, and each group is scaled once: s·d·(Σ c·q − z·Σq). The float
// kernel (quant_cpu.cpp) converts and multiplies every code in float32 instead, which makes it
// compute-bound below the memory bandwidth that the packed codes would allow.
#include "quant_int8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define MOELAB_INT8_X86 1
#define MOELAB_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#endif

namespace moelab {

bool int8_dot_supported() {
#ifdef MOELAB_INT8_X86
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

void quantize_rows_int8(const float* x, int64_t N, int64_t K, int64_t group, int64_t bits,
                        int8_t* q, float* d, int32_t* qsum) {
  const int64_t G = K / group;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + n * K + g * group;
      int8_t* qg = q + n * K + g * group;
      float amax = 0.0f;
      for (int64_t j = 0; j < group; ++j) amax = std::max(amax, std::fabs(xg[j]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int64_t j = 0; j < group; ++j) {
        // nearest, ties to even (the default rounding mode), as torch.round
        const int32_t v = std::clamp(static_cast<int32_t>(std::nearbyint(xg[j] * inv)), -127, 127);
        const int64_t r = j % 64;  // at 4 bits: even columns of the chunk first, then odd ones
        qg[bits == 4 ? j - r + (r % 2) * 32 + r / 2 : j] = static_cast<int8_t>(v);
        sum += v;
      }
      d[n * G + g] = amax / 127.0f;
      qsum[n * G + g] = sum;
    }
  }
}

#ifdef MOELAB_INT8_X86
namespace {

// Each weight row asks for the row 16 KB further on. Without this the hardware prefetchers
// keep too few lines in flight for a thread that spends several cycles on each 64 bytes:
// at one input row the kernel read an LM head-sized or expert-sized weight (8 bits) at
// about 60 % of `torch.sum`'s rate from memory, and 16 KB ahead read it 27-32 % faster
// (medians of an interleaved A/B; 4-8 KB gained less, 24-64 KB no more). At 4 rows it
// gained 0-17 %; at 8 the dot products bound the kernel and it changes nothing. A prefetch
// past the codes' end does not fault.
constexpr int64_t kPrefetchBytes = 16384;

// One expert's output rows [o0, o1) for its M rows. Per group: M int32 accumulators start at
// −z·Σq (lane 0) and take one vpdpbusd per 64 codes; converted once, scaled by s·d into M
// float accumulators, reduced once per output. A group's lane sums stay below 2^24 up to
// groups of 128 columns, so the conversion is exact there.
template <int64_t M, int64_t Bits>
MOELAB_VNNI void rows_vnni(const int8_t* q, const float* d, const int32_t* qsum, int64_t K,
                           const uint8_t* codes, const at::Half* scales, const uint8_t* zeros,
                           int64_t G, int64_t o0, int64_t o1, float* out, int64_t ldo) {
  const int64_t chunks = K / G / 64, row_bytes = K * Bits / 8;
  const int32_t zero_sym = 1 << (Bits - 1);
  const auto* half_bits = reinterpret_cast<const uint16_t*>(scales);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = codes + o * row_bytes;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(row) + kPrefetchBytes;  // may pass the end
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T0);
    __m512 acc[M];
    for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const float s = _cvtsh_ss(half_bits[o * G + g]);
      const int32_t z = zeros != nullptr ? zeros[o * G + g] : zero_sym;
      __m512i dot[M];
      for (int64_t m = 0; m < M; ++m)
        dot[m] = _mm512_zextsi128_si512(_mm_cvtsi32_si128(-z * qsum[m * G + g]));
      for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c) {
        __m512i w;
        if constexpr (Bits == 8) {
          w = _mm512_loadu_si512(row + c * 64);
        } else {  // 32 bytes: low nibbles to lanes 0-31, high nibbles to lanes 32-63
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32));
          w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, low4)),
                                 _mm256_and_si256(_mm256_srli_epi16(b, 4), low4), 1);
        }
        for (int64_t m = 0; m < M; ++m)
          dot[m] = _mm512_dpbusd_epi32(dot[m], w, _mm512_loadu_si512(q + m * K + c * 64));
      }
      for (int64_t m = 0; m < M; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(s * d[m * G + g]),
                                 acc[m]);
    }
    for (int64_t m = 0; m < M; ++m) out[m * ldo + o] = _mm512_reduce_add_ps(acc[m]);
  }
}

template <int64_t Bits, int64_t... Ms>
void rows_any(std::integer_sequence<int64_t, Ms...>, int64_t M, const int8_t* q, const float* d,
              const int32_t* qsum, int64_t K, const uint8_t* codes, const at::Half* scales,
              const uint8_t* zeros, int64_t G, int64_t o0, int64_t o1, float* out, int64_t ldo) {
  ((M == Ms + 1 ? rows_vnni<Ms + 1, Bits>(q, d, qsum, K, codes, scales, zeros, G, o0, o1, out, ldo)
                : void()),
   ...);
}

}  // namespace
#endif

void quant_rows_int8(int64_t M, const int8_t* q, const float* d, const int32_t* qsum, int64_t K,
                     const uint8_t* codes, const at::Half* scales, const uint8_t* zeros,
                     int64_t G, int64_t bits, int64_t o0, int64_t o1, float* out, int64_t ldo) {
#ifdef MOELAB_INT8_X86
  const auto rows = std::make_integer_sequence<int64_t, 8>();
  if (bits == 8)
    rows_any<8>(rows, M, q, d, qsum, K, codes, scales, zeros, G, o0, o1, out, ldo);
  else
    rows_any<4>(rows, M, q, d, qsum, K, codes, scales, zeros, G, o0, o1, out, ldo);
#else
  TORCH_CHECK(false, "the integer decode kernel needs an x86-64 CPU with AVX-512 VNNI");
#endif
}

}  // namespace moelab
