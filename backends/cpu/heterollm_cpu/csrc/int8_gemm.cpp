// An int8-weight GEMM on AVX2's 16-bit multiply-add, for CPUs without int8 dot-product instructions
// (no AVX512-VNNI, AVX-VNNI or AMX-int8: an AMD EPYC Zen 2 / Zen 3, say), where torch's int8 GEMMs run a
// reference loop. `--quantization wint8` (every batch size) and, on such CPUs, `w8a8` run on it (linear.py).
//
// int8_gemm(x (..., K) fp32 or bf16, panels (P, ceil(K / 2), 16, 2) int8, w_scale (N) fp32, qmax, bias (N)?)
//   -> (..., N) in x's dtype
// panels: the (N, K) int8 weight codes in panels of 16 output channels (N padded with zero rows to 16 P),
// K padded with a zero column to an even count, each pair of input features of the 16 channels stored
// together (linear.py's `pack_int8_panels`): one 32-byte row per pair, byte 2n + i = w[16p + n, 2j + i].
// Row m of x is quantized symmetrically to integers in [-qmax, qmax] (1 <= qmax <= 32767):
// s_m = max |x_m| / qmax, q = round_half_even(x_m / s_m) (a row of zeros, or of values under qmax / FLT_MAX:
// q = 0, s = 1; a row with a NaN or an infinity: q = 0, s = NaN, so its outputs are NaN).
// y[m, n] = s_m * w_scale[n] * sum_k q[m, k] w[n, k] (+ bias[n]).
// With qmax = 127 these are w8a8's numbers (quantize_rows.h, as int8_linear.cpp quantizes; the same integer sums);
// wint8 takes qmax = 32767, the activations' rounding ~1e-5 of the row's largest value.
// The sums: _mm256_madd_epi16 multiplies the int16 activations by the int8 codes widened to int16 and
// adds adjacent pairs into int32 (16 products an instruction, twice an AVX2 FMA's 8); the int32 sums
// cover 256 input features at a time (256 * 32767 * 128 < 2^31: no overflow at any qmax) and are then
// added into fp32. A tile is 6 rows x 16 channels (12 accumulators). Without AVX2: the same sums in a
// scalar loop.
#include <torch/extension.h>
#include "quantize_rows.h"
#include "scalar_types.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace heterollm_cpu;

constexpr int64_t kNR = 16;        // output channels per panel
constexpr int64_t kMR = 6;         // rows per tile
constexpr int64_t kChunkPairs = 128;  // input-feature pairs summed in int32 before the fp32 add
constexpr int64_t kBlockBytes = 192 * 1024;  // the quantized rows of one row block (kept in L2)

// c[MR][16] += the sums over pairs [j0, j1) of rows a (stride lda int16) with the panel b
template <int MR>
inline void tile_sums(const int16_t* a, int64_t lda, const int8_t* b, int64_t j0, int64_t j1, float* c) {
#if defined(__AVX2__)
  __m256i acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  for (int64_t j = j0; j < j1; ++j) {
    const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + j * 32)));
    const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + j * 32 + 16)));
    madd_pair<MR>(a, lda, j, b0, b1, acc);
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(c + m * kNR, _mm256_add_ps(_mm256_loadu_ps(c + m * kNR), _mm256_cvtepi32_ps(acc[m][0])));
    _mm256_storeu_ps(c + m * kNR + 8,
                     _mm256_add_ps(_mm256_loadu_ps(c + m * kNR + 8), _mm256_cvtepi32_ps(acc[m][1])));
  }
#else
  for (int m = 0; m < MR; ++m) {
    int32_t acc[kNR] = {0};
    for (int64_t j = j0; j < j1; ++j) {
      const int32_t x0 = a[m * lda + 2 * j], x1 = a[m * lda + 2 * j + 1];
      for (int n = 0; n < kNR; ++n) acc[n] += x0 * b[j * 32 + 2 * n] + x1 * b[j * 32 + 2 * n + 1];
    }
    for (int n = 0; n < kNR; ++n) c[m * kNR + n] += static_cast<float>(acc[n]);
  }
#endif
}

template <int MR>
void tile(const int16_t* a, int64_t lda, const int8_t* b, int64_t pairs, float* c) {
  std::fill(c, c + MR * kNR, 0.f);
  for (int64_t j0 = 0; j0 < pairs; j0 += kChunkPairs) tile_sums<MR>(a, lda, b, j0, std::min(pairs, j0 + kChunkPairs), c);
}

template <typename S>
void gemm(const int16_t* q, const float* sx, const int8_t* panels, const float* sw, const typename S::T* bias,
          int64_t rows, int64_t kp, int64_t n, typename S::T* y) {
  const int64_t pairs = kp / 2, npanels = (n + kNR - 1) / kNR;
  const int64_t block = std::max<int64_t>(kMR, kBlockBytes / (2 * kp) / kMR * kMR);
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t r1 = std::min(rows, r0 + block);
    at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
      alignas(32) float c[kMR * kNR];
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* b = panels + p * pairs * 32;
        const int64_t n0 = p * kNR, nn = std::min(kNR, n - n0);
        for (int64_t m0 = r0; m0 < r1; m0 += kMR) {
          const int64_t mr = std::min(kMR, r1 - m0);
          const int16_t* a = q + m0 * kp;
          switch (mr) {
            case 1: tile<1>(a, kp, b, pairs, c); break;
            case 2: tile<2>(a, kp, b, pairs, c); break;
            case 3: tile<3>(a, kp, b, pairs, c); break;
            case 4: tile<4>(a, kp, b, pairs, c); break;
            case 5: tile<5>(a, kp, b, pairs, c); break;
            default: tile<6>(a, kp, b, pairs, c); break;
          }
          for (int64_t m = 0; m < mr; ++m) {
            const float s = sx[m0 + m];
            typename S::T* out = y + (m0 + m) * n + n0;
            for (int64_t j = 0; j < nn; ++j) {
              const float v = c[m * kNR + j] * (s * sw[n0 + j]);
              S::store(out, j, bias != nullptr ? v + S::load(bias, n0 + j) : v);
            }
          }
        }
      }
    });
  }
}

torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor panels, torch::Tensor w_scale, int64_t qmax,
                        c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(panels.scalar_type() == torch::kChar && panels.dim() == 4 && panels.size(2) == kNR && panels.size(3) == 2,
              "panels must be (P, ceil(K / 2), 16, 2) int8");
  TORCH_CHECK(panels.is_contiguous(), "panels must be contiguous");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat && w_scale.dim() == 1, "w_scale must be (N) float32");
  TORCH_CHECK(qmax >= 1 && qmax <= 32767, "qmax must be in [1, 32767]");
  const int64_t k = x.size(-1), n = w_scale.numel(), kp = 2 * panels.size(1);
  TORCH_CHECK(kp == k + (k & 1), "x's last dimension (", k, ") does not match the panels' ", kp, " features");
  TORCH_CHECK(panels.size(0) == (n + kNR - 1) / kNR, "panels hold ", panels.size(0), " panels of 16, w_scale ", n,
              " channels");
  const auto [x2, out_shape] = as_rows(x, n);
  const int64_t rows = x2.size(0);
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y.view(out_shape);
  auto q = torch::empty({rows, kp}, x.options().dtype(torch::kShort));
  auto sx = torch::empty({rows}, x.options().dtype(torch::kFloat));
  auto ws = w_scale.contiguous();
  const torch::Tensor b = checked_bias(bias, x, n);
  quantize_rows_of(x2, kp, qmax, q.data_ptr<int16_t>(), sx.data_ptr<float>());
  if (x.scalar_type() == torch::kBFloat16) {
    gemm<BF16>(q.data_ptr<int16_t>(), sx.data_ptr<float>(), panels.data_ptr<int8_t>(), ws.data_ptr<float>(),
               b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr, rows, kp, n,
               reinterpret_cast<uint16_t*>(y.data_ptr()));
  } else {
    gemm<F32>(q.data_ptr<int16_t>(), sx.data_ptr<float>(), panels.data_ptr<int8_t>(), ws.data_ptr<float>(),
              b.defined() ? b.data_ptr<float>() : nullptr, rows, kp, n, y.data_ptr<float>());
  }
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("int8_gemm(Tensor x, Tensor panels, Tensor w_scale, int qmax, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("int8_gemm", &int8_gemm); }
