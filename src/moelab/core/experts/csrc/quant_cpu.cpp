// Quantized experts at decode: y[r, o] = Σ_g s[e,o,g] · Σ_{j∈g} (q[e,o,j] − z[e,o,g]) · x[r, j]
// for the few rows r routed to expert e, straight from the packed codes (1 byte per weight at
// 8 bits, half a byte at 4) instead of a dequantized float32 copy of the expert (4 bytes per
// weight written, then read again by the GEMM). Layout: moelab/core/experts/qformat.py.
#include "quant_cpu.h"

#include <algorithm>
#include <vector>

#include "kernel_common.h"
#include "quant_int8.h"

namespace {

constexpr int64_t kMaxRows = 8;        // decode-sized experts; more rows go to dequant + GEMM
constexpr int64_t kLanes = 16;         // independent partial sums per output (one 512-bit vector)
constexpr int64_t kRowsPerItem = 64;   // output rows per work item

struct QItem {
  // job: index into the projections; slot: into `experts`; rows [begin, begin+rows)
  int64_t job, slot, begin, rows, o0, o1;
};

// Output rows [o0, o1) of one expert for its M input rows x [M, K]; codes, scales and zeros
// point at the expert's first weight row. A 4-bit byte b holds codes 2b (low nibble) and 2b+1
// (high): the inputs are split once into even and odd columns, so both nibbles of a run of
// bytes meet contiguous inputs and the loop vectorises. Every row accumulates in kLanes
// independent partial sums (vectorised without reassociating one sum), reduced once per
// output; each code enters as q·s − z·s, the group's scale folded in.
template <int64_t M, int64_t Bits>
MOELAB_CLONES void quant_rows(const float* x, int64_t K, const uint8_t* codes,
                              const at::Half* scales, const uint8_t* zeros, int64_t G, int64_t o0,
                              int64_t o1, float* out, int64_t ldo) {
  constexpr int64_t kPerByte = 8 / Bits;
  const int64_t nb = K / kPerByte, gb = nb / G;  // bytes per row, per group
  std::vector<float> xs(M * K);                  // xs[(m·kPerByte + h)·nb + b] = x[m, b·kPerByte + h]
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t h = 0; h < kPerByte; ++h)
        xs[(m * kPerByte + h) * nb + b] = x[m * K + b * kPerByte + h];
  const float zero_sym = static_cast<float>(1 << (Bits - 1));
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* __restrict row = codes + o * nb;
    float acc[M][kLanes] = {};
    float tail[M] = {};
    for (int64_t g = 0; g < G; ++g) {
      const float s = static_cast<float>(scales[o * G + g]);
      const float zs = (zeros != nullptr ? zeros[o * G + g] : zero_sym) * s;
      int64_t b = g * gb;
      const int64_t end = b + gb;
      for (; b + kLanes <= end; b += kLanes) {
        // byte operations first, then the conversions: each loop is one simple vector op
        uint8_t cl[kLanes], ch[kLanes];
        float lo[kLanes], hi[kLanes];
        for (int64_t l = 0; l < kLanes; ++l) cl[l] = Bits == 8 ? row[b + l] : row[b + l] & 15;
        for (int64_t l = 0; l < kLanes; ++l) lo[l] = static_cast<float>(cl[l]) * s - zs;
        if constexpr (Bits == 4) {
          for (int64_t l = 0; l < kLanes; ++l) ch[l] = row[b + l] >> 4;
          for (int64_t l = 0; l < kLanes; ++l) hi[l] = static_cast<float>(ch[l]) * s - zs;
        }
        for (int64_t m = 0; m < M; ++m) {
          const float* __restrict xe = xs.data() + m * kPerByte * nb + b;
          for (int64_t l = 0; l < kLanes; ++l) acc[m][l] += lo[l] * xe[l];
          if constexpr (Bits == 4) {
            const float* __restrict xo = xe + nb;
            for (int64_t l = 0; l < kLanes; ++l) acc[m][l] += hi[l] * xo[l];
          }
        }
      }
      for (; b < end; ++b) {
        const uint8_t c = row[b];
        for (int64_t m = 0; m < M; ++m) {
          const float* xe = xs.data() + m * kPerByte * nb + b;
          tail[m] += (static_cast<float>(Bits == 8 ? c : c & 15) * s - zs) * xe[0];
          if constexpr (Bits == 4) tail[m] += (static_cast<float>(c >> 4) * s - zs) * xe[nb];
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      float sum = tail[m];
      for (int64_t l = 0; l < kLanes; ++l) sum += acc[m][l];
      out[m * ldo + o] = sum;
    }
  }
}

template <int64_t Bits, int64_t... Ms>
void quant_rows_any(std::integer_sequence<int64_t, Ms...>, int64_t M, const float* x, int64_t K,
                    const uint8_t* codes, const at::Half* scales, const uint8_t* zeros,
                    int64_t G, int64_t o0, int64_t o1, float* out, int64_t ldo) {
  ((M == Ms + 1 ? quant_rows<Ms + 1, Bits>(x, K, codes, scales, zeros, G, o0, o1, out, ldo)
                : void()),
   ...);
}

}  // namespace

// y [N, O] for the rows x [N, K] (float32, sorted by expert: counts[i] rows of expert
// experts[i], each 1..kMaxRows) of one quantized projection: codes uint8 (the whole
// projection's packed [E, O, K] codes), scales float16 [E, O, G], zeros uint8 [E, O, G]
// (unpacked; none = symmetric, zero point 2^(bits-1)), bits 4 or 8. `int8_activations`: where
// the CPU has AVX-512 VNNI and groups are a multiple of 64 columns, the rows are quantized to
// int8 per group and multiplied with integer dot products (quant_int8.cpp); else in float32.
at::Tensor quant_experts_mm(const at::Tensor& x, const std::vector<int64_t>& counts,
                            const std::vector<int64_t>& experts, const at::Tensor& codes,
                            const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                            int64_t bits, int64_t out_features, bool int8_activations) {
  return quant_experts_mm_many(x, counts, experts, {{codes, scales, zeros, bits, out_features}},
                               int8_activations)[0];
}

std::vector<at::Tensor> quant_experts_mm_many(const at::Tensor& x,
                                              const std::vector<int64_t>& counts,
                                              const std::vector<int64_t>& experts,
                                              const std::vector<QuantWeights>& projections,
                                              bool int8_activations) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x: expected a contiguous float32 [N, K] tensor");
  TORCH_CHECK(!projections.empty(), "projections: none given");
  const int64_t N = x.size(0), K = x.size(1);
  const int64_t bits = projections[0].bits, G = projections[0].scales.size(-1);
  std::vector<const uint8_t*> zps;
  int64_t E = -1, width = 0;
  for (const auto& p : projections) {
    const int64_t O = p.out_features;
    TORCH_CHECK(p.bits == bits && (bits == 8 || bits == 4), "bits: 8 or 4, one for all, got ",
                p.bits);
    TORCH_CHECK(p.scales.scalar_type() == at::kHalf && p.scales.dim() == 3 &&
                    p.scales.size(1) == O && p.scales.size(2) == G && p.scales.is_contiguous(),
                "scales: expected contiguous float16 [E, ", O, ", ", G, "]");
    TORCH_CHECK(E < 0 || p.scales.size(0) == E, "projections: different expert counts");
    E = p.scales.size(0);
    TORCH_CHECK(G > 0 && K % G == 0 && (bits == 8 || (K / G) % 2 == 0), "scales: ", G,
                " groups of K = ", K, " columns (at 4 bits groups must start on a byte)");
    TORCH_CHECK(p.codes.scalar_type() == at::kByte && p.codes.is_contiguous() &&
                    p.codes.numel() >= E * O * K * bits / 8,
                "codes: expected the packed uint8 codes of [", E, ", ", O, ", ", K, "]");
    const uint8_t* zp = nullptr;
    if (p.zeros.has_value()) {
      TORCH_CHECK(p.zeros->scalar_type() == at::kByte && p.zeros->is_contiguous() &&
                      p.zeros->sizes() == p.scales.sizes(),
                  "zeros: expected contiguous uint8 like scales");
      zp = p.zeros->data_ptr<uint8_t>();
    }
    zps.push_back(zp);
    width += O;
  }
  TORCH_CHECK(counts.size() == experts.size(), "counts and experts differ in length");
  std::vector<QItem> items;
  for (size_t j = 0; j < projections.size(); ++j) {
    const int64_t O = projections[j].out_features;
    int64_t begin = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      TORCH_CHECK(counts[i] >= 1 && counts[i] <= kMaxRows, "counts[", i, "] = ", counts[i],
                  " outside [1, ", kMaxRows, "]");
      TORCH_CHECK(experts[i] >= 0 && experts[i] < E, "experts[", i, "] = ", experts[i],
                  " outside [0, ", E, ")");
      for (int64_t o0 = 0; o0 < O; o0 += kRowsPerItem)
        items.push_back({static_cast<int64_t>(j), static_cast<int64_t>(i), begin, counts[i], o0,
                         std::min(O, o0 + kRowsPerItem)});
      begin += counts[i];
    }
    TORCH_CHECK(begin == N, "counts sum to ", begin, ", x has ", N, " rows");
  }
  std::vector<at::Tensor> ys;
  for (const auto& p : projections) ys.push_back(at::empty({N, p.out_features}, x.options()));
  const float* xp = x.data_ptr<float>();
  const bool integer = int8_activations && moelab::int8_dot_supported() && (K / G) % 64 == 0;
  std::vector<int8_t> q(integer ? N * K : 0);  // the rows' int8 codes, steps and code sums
  std::vector<float> d(integer ? N * G : 0);
  std::vector<int32_t> qsum(integer ? N * G : 0);
  if (integer) moelab::quantize_rows_int8(xp, N, K, K / G, bits, q.data(), d.data(), qsum.data());
  moelab::run_items(items, [&](const QItem& it) {
    const auto& p = projections[it.job];
    const int64_t e = experts[it.slot], O = p.out_features;
    const auto rows = std::make_integer_sequence<int64_t, kMaxRows>();
    const uint8_t* ce = p.codes.data_ptr<uint8_t>() + e * O * K * bits / 8;
    const at::Half* se = p.scales.data_ptr<at::Half>() + e * O * G;
    const uint8_t* ze = zps[it.job] == nullptr ? nullptr : zps[it.job] + e * O * G;
    float* yp = ys[it.job].data_ptr<float>() + it.begin * O;
    if (integer)
      moelab::quant_rows_int8(it.rows, q.data() + it.begin * K, d.data() + it.begin * G,
                              qsum.data() + it.begin * G, K, ce, se, ze, G, bits, it.o0, it.o1,
                              yp, O);
    else if (bits == 8)
      quant_rows_any<8>(rows, it.rows, xp + it.begin * K, K, ce, se, ze, G, it.o0, it.o1, yp, O);
    else
      quant_rows_any<4>(rows, it.rows, xp + it.begin * K, K, ce, se, ze, G, it.o0, it.o1, yp, O);
  }, /*adaptive=*/true, moelab::scheduler_slot({3, K, width, N, bits}));  // decode-sized rows only
  return ys;
}

void expert_tiles(const int64_t* counts, int64_t E, std::vector<int64_t>& tiles,
                  std::vector<int64_t>& experts) {
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(counts[e] >= 0, "counts[", e, "] = ", counts[e], " < 0");
    for (int64_t start = 0; start < counts[e]; start += kMaxRows) {
      tiles.push_back(std::min(kMaxRows, counts[e] - start));
      experts.push_back(e);
    }
  }
}

// The operator moelab::quant_rows_mm: counts int64 [E] rows per expert, in order (zeros
// allowed), run as tiles of at most kMaxRows rows of one expert.
at::Tensor quant_rows_mm(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& codes,
                         const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                         int64_t bits, int64_t out_features, bool int8_activations) {
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong && counts.is_cpu(),
              "counts: expected an int64 [E] CPU tensor");
  const auto c = counts.contiguous();
  std::vector<int64_t> tiles, experts;
  expert_tiles(c.data_ptr<int64_t>(), c.numel(), tiles, experts);
  return quant_experts_mm(x.contiguous(), tiles, experts, codes, scales, zeros, bits,
                          out_features, int8_activations);
}
