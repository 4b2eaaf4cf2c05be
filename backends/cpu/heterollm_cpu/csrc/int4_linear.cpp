// The CPU backend's 4-bit weight-only linear (`--quantization wint4`, linear.py's WeightOnlyInt4; GPTQ and
// AWQ checkpoints too): asymmetric 4-bit codes in groups along the input features,
// w[n, k] = code[n, k] * scale[n, g] + min[n, g] with g = k / group (GGUF's Q4_1 for a group of 32).
//
// int4_linear(x (..., K) fp32 or bf16, panels (P, K / 2, 16) uint8, scales (P, K / G, 16) fp32,
//             mins (P, K / G, 16) fp32, G, N, bias (N) in x's dtype or None) -> (..., N) in x's dtype
// The weight goes in panels of 16 output channels (N padded with zero codes, scales and minima to
// P = ceil(N / 16) panels), one 16-byte row per pair of input features (linear.py's `pack_int4_panels`):
// with v[2n + i] = code[16p + n, 2j + i] (n < 16, i < 2), byte b of pair-row j holds v[b] in its low
// nibble and v[b + 16] in its high one. The scales and minima go panel-major, the 16 channels of a
// group side by side. G is an even number of features dividing K (the packing makes it a multiple of 32).
//
// Up to kGemvRows rows (decode), on AVX2 (every x86 CPU with AVX-512 has it too): each row of x is
// quantized to int16 (quantize_rows.h, qmax 32767: x ~ s_m * q, each value kept to 1 / 65534 of the
// row's largest; a row with a NaN or an infinity gives NaN outputs), a pair-row's 32 codes widen to
// int16 once (an and, a shift, two zero-extensions), `_mm256_madd_epi16` against the broadcast pair of
// q sums code * q into int32 for 16 channels at a time, kept in int32 over a group (at most
// 2 * 15 * 32767 a lane a pair: kFlushPairs = 2,048 pairs stay under 2^31) and then added into fp32 scaled by
// s_m * scale, with min * (the group's sum of x, in fp32). A tile is up to 3 rows x 16 channels; the
// work is split across threads by panel. No horizontal sums, so a layer of few input features costs
// no more per weight than a wide one (the layout before this one kept a weight row's codes together
// and summed each output with a horizontal add: 1.0-2.4x slower at one row on SmolLM2's shapes,
// bench/RESULTS.md, session 19). Without AVX2 a scalar loop does the same sums on fp32 x.
// More rows (prefill) dequantize the weight, transposed (K, 16-channel columns), panel chunk by chunk,
// and multiply with at::mm (the fp32 GEMM), where the dequantization costs less than a few rows of the
// product. The result is F.linear(x, w) to within x's int16 rounding on AVX2 at few rows, fp32
// summation order otherwise.
#include <torch/extension.h>
#include "quantize_rows.h"
#include "scalar_types.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HETEROLLM_INT4_AVX2 1
#endif

namespace {

using namespace heterollm_cpu;

constexpr int64_t kNR = 16;                 // output channels per panel
constexpr int64_t kMR = 3;                  // rows per tile
constexpr int64_t kGemvRows = 128;          // above this many rows: dequantize + GEMM (measured crossover)
constexpr int64_t kFlushPairs = 2048;       // int32 sums cover at most this many feature pairs (2^31 / 983,010)
constexpr int64_t kChunkBytes = 4 << 20;    // the fp32 weight chunk a GEMM call takes

#if HETEROLLM_INT4_AVX2
// c[MR][16] = for rows a (int16, stride lda) with row scales sx: sum_g s_m * scale_g * (code . q)_g +
// min_g * xsum[m, g], for one panel b (pair-rows of 16 bytes), its scales sc and minima mn (groups x 16)
template <int MR>
void panel_tile(const int16_t* a, int64_t lda, const float* sx, const float* xsum, int64_t groups, int64_t gpairs,
                const uint8_t* b, const float* sc, const float* mn, float* c) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  __m256 f[MR][2];
  for (int m = 0; m < MR; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s0 = _mm256_loadu_ps(sc + g * kNR), s1 = _mm256_loadu_ps(sc + g * kNR + 8);
    const int64_t end = (g + 1) * gpairs;
    for (int64_t j0 = g * gpairs; j0 < end; j0 += kFlushPairs) {
      __m256i acc[MR][2];
      for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
      for (int64_t j = j0, j1 = std::min(end, j0 + kFlushPairs); j < j1; ++j) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + j * 16));
        const __m256i b0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, nibble));                     // channels 0..7
        const __m256i b1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble));  // 8..15
        madd_pair<MR>(a, lda, j, b0, b1, acc);
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 sm = _mm256_set1_ps(sx[m]);
        f[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][0]), _mm256_mul_ps(s0, sm), f[m][0]);
        f[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][1]), _mm256_mul_ps(s1, sm), f[m][1]);
      }
    }
    const __m256 l0 = _mm256_loadu_ps(mn + g * kNR), l1 = _mm256_loadu_ps(mn + g * kNR + 8);
    for (int m = 0; m < MR; ++m) {
      const __m256 xs = _mm256_set1_ps(xsum[m * groups + g]);
      f[m][0] = _mm256_fmadd_ps(l0, xs, f[m][0]);
      f[m][1] = _mm256_fmadd_ps(l1, xs, f[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(c + m * kNR, f[m][0]);
    _mm256_storeu_ps(c + m * kNR + 8, f[m][1]);
  }
}
#endif

// the code of channel n (< 16), feature 2j + i in a panel
inline int code_at(const uint8_t* b, int64_t j, int n, int i) {
  const int v = 2 * n + i;
  const uint8_t byte = b[j * 16 + (v & 15)];
  return v < 16 ? (byte & 0x0F) : (byte >> 4);
}

// the scalar loop: c[m][16] for rows x (fp32, stride k) against one panel
void panel_tile_scalar(const float* x, int64_t rows, int64_t k, const float* xsum, int64_t groups, int64_t group,
                       const uint8_t* b, const float* sc, const float* mn, float* c) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int n = 0; n < kNR; ++n) {
      float out = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float t = 0.f;
        for (int64_t f = g * group; f < (g + 1) * group; ++f) t += static_cast<float>(code_at(b, f / 2, n, f & 1)) * x[m * k + f];
        out += sc[g * kNR + n] * t + mn[g * kNR + n] * xsum[m * groups + g];
      }
      c[m * kNR + n] = out;
    }
  }
}

// panels [p0, p1) dequantized and transposed: wt (k, 16 * (p1 - p0)) fp32, wt[f, 16 (p - p0) + n] = w[16p + n, f]
void dequantize_t(const uint8_t* panels, const float* scales, const float* mins, int64_t k, int64_t groups,
                  int64_t group, int64_t p0, int64_t p1, float* wt) {
  const int64_t ld = kNR * (p1 - p0);
  at::parallel_for(p0, p1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* b = panels + p * (k / 2) * 16;
      const float* sc = scales + p * groups * kNR;
      const float* mn = mins + p * groups * kNR;
      float* col = wt + (p - p0) * kNR;
      for (int64_t j = 0; j < k / 2; ++j) {
        const int64_t g = 2 * j / group;
        float* r0 = col + (2 * j) * ld;
        float* r1 = r0 + ld;
#if HETEROLLM_INT4_AVX2
        // bytes 0..15 hold v[0..15] (channels 0..7, both features) low and v[16..31] high; put each
        // feature's 16 channels together: evens (feature 2j) then odds (2j + 1)
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + j * 16));
        const __m128i nibble = _mm_set1_epi8(0x0F);
        const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        const __m128i lo = _mm_shuffle_epi8(_mm_and_si128(raw, nibble), split);                     // ch 0..7
        const __m128i hi = _mm_shuffle_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble), split);  // ch 8..15
        const __m128i f0 = _mm_unpacklo_epi64(lo, hi), f1 = _mm_unpackhi_epi64(lo, hi);
        const __m256 s0 = _mm256_loadu_ps(sc + g * kNR), s1 = _mm256_loadu_ps(sc + g * kNR + 8);
        const __m256 l0 = _mm256_loadu_ps(mn + g * kNR), l1 = _mm256_loadu_ps(mn + g * kNR + 8);
        _mm256_storeu_ps(r0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(f0)), s0, l0));
        _mm256_storeu_ps(r0 + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(f0, 8))), s1, l1));
        _mm256_storeu_ps(r1, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(f1)), s0, l0));
        _mm256_storeu_ps(r1 + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(f1, 8))), s1, l1));
#else
        for (int n = 0; n < kNR; ++n) {
          r0[n] = static_cast<float>(code_at(b, j, n, 0)) * sc[g * kNR + n] + mn[g * kNR + n];
          r1[n] = static_cast<float>(code_at(b, j, n, 1)) * sc[g * kNR + n] + mn[g * kNR + n];
        }
#endif
      }
    }
  });
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, torch::Tensor mins,
                          int64_t group, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(panels.scalar_type() == torch::kByte && panels.dim() == 3 && panels.size(2) == kNR,
              "panels must be (P, K / 2, 16) uint8");
  TORCH_CHECK(panels.is_contiguous(), "panels must be contiguous");
  const int64_t npanels = panels.size(0), k = panels.size(1) * 2;
  TORCH_CHECK(x.size(-1) == k, "x's last dimension (", x.size(-1), ") does not match the panels' ", k, " features");
  TORCH_CHECK(group > 0 && group % 2 == 0 && k % group == 0, "the group size must be even and divide K");
  TORCH_CHECK(n > 0 && npanels == (n + kNR - 1) / kNR, "panels hold ", npanels, " panels of 16, not ", n, " channels");
  const int64_t groups = k / group;
  for (const auto& [t, name] : {std::pair{scales, "scales"}, std::pair{mins, "mins"}}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() &&
                    t.sizes() == torch::IntArrayRef({npanels, groups, kNR}),
                name, " must be contiguous (P, K / group, 16) float32");
  }
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  auto xf = x.reshape({-1, k}).to(torch::kFloat).contiguous();
  const int64_t rows = xf.size(0);
  if (rows == 0) return torch::empty(out_shape, x.options());
  const uint8_t* bp = panels.data_ptr<uint8_t>();
  const float *sp = scales.data_ptr<float>(), *lp = mins.data_ptr<float>();
  auto y = torch::empty({rows, n}, xf.options());
  float* yp = y.data_ptr<float>();
  if (rows <= kGemvRows) {
    const float* xp = xf.data_ptr<float>();
    std::vector<float> xsum(rows * groups);  // (rows, groups): sum of x over each group, in fp32
    for (int64_t i = 0; i < rows * groups; ++i) {
      float t = 0.f;
      for (int64_t f = 0; f < group; ++f) t += xp[i * group + f];
      xsum[i] = t;
    }
#if HETEROLLM_INT4_AVX2
    std::vector<int16_t> q(rows * k);
    std::vector<float> sx(rows);
    quantize_rows<F32>(xp, rows, k, k, 32767, q.data(), sx.data());
#endif
    at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
      alignas(32) float c[kGemvRows * kNR];
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* b = bp + p * (k / 2) * kNR;
        const float* sc = sp + p * groups * kNR;
        const float* mn = lp + p * groups * kNR;
        const int64_t n0 = p * kNR, nn = std::min(kNR, n - n0);
#if HETEROLLM_INT4_AVX2
        for (int64_t m0 = 0; m0 < rows; m0 += kMR) {
          const int16_t* a = q.data() + m0 * k;
          const float *s = sx.data() + m0, *xs = xsum.data() + m0 * groups;
          switch (std::min(kMR, rows - m0)) {
            case 3: panel_tile<3>(a, k, s, xs, groups, group / 2, b, sc, mn, c + m0 * kNR); break;
            case 2: panel_tile<2>(a, k, s, xs, groups, group / 2, b, sc, mn, c + m0 * kNR); break;
            default: panel_tile<1>(a, k, s, xs, groups, group / 2, b, sc, mn, c + m0 * kNR); break;
          }
        }
#else
        panel_tile_scalar(xp, rows, k, xsum.data(), groups, group, b, sc, mn, c);
#endif
        for (int64_t m = 0; m < rows; ++m) std::memcpy(yp + m * n + n0, c + m * kNR, nn * sizeof(float));
      }
    });
  } else {
    const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(npanels, kChunkBytes / (k * 4 * kNR)));
    auto wt = torch::empty({k, chunk * kNR}, xf.options());
    for (int64_t p0 = 0; p0 < npanels; p0 += chunk) {
      const int64_t p1 = std::min(npanels, p0 + chunk), n0 = p0 * kNR, n1 = std::min(n, p1 * kNR);
      auto w = wt.narrow(1, 0, (p1 - p0) * kNR);
      if (p1 - p0 < chunk) w = torch::empty({k, (p1 - p0) * kNR}, xf.options());  // the last, shorter chunk
      dequantize_t(bp, sp, lp, k, groups, group, p0, p1, w.data_ptr<float>());
      y.narrow(1, n0, n1 - n0).copy_(at::mm(xf, w).narrow(1, 0, n1 - n0));
    }
  }
  const torch::Tensor b = checked_bias(bias, x, n);
  if (b.defined()) y.add_(b.to(torch::kFloat).view({1, n}));
  return y.to(x.scalar_type()).view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor panels, Tensor scales, Tensor mins, int group, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("int4_linear", &int4_linear); }
