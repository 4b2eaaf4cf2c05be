// `--quantization wint4` on CPUs with AVX512-VNNI (AMD Zen 4 on, Intel Ice Lake on): the 4-bit weight
// times int8 activations with the 4-way byte dot product (vpdpbusd), where int4_linear.cpp widens every
// code to 16 bits for a 256-bit multiply-add (AVX2): about 5x fewer instructions a weight, so a decode
// step reads the weight at the memory's pace (measured: bench/RESULTS.md, session 21).
//
// int4_dot_linear(x (..., K) fp32 or bf16, panels (P, K / 8, 64) uint8, scales (P, K / G, 16) fp32,
//                 mins (P, K / G, 16) fp16, G, N, bias (N) in x's dtype or None) -> (..., N) in x's dtype
// The weight w[n, k] = code[n, k] * scale[n, g] + min[n, g] (g = k / G, codes in [0, 15]) goes in panels of
// 16 output channels (N padded with zero codes, scales and minima), one 64-byte row per octet of input
// features (linear.py's `pack_int4_quads`): byte 4n + i of octet-row t holds code[16p + n, 8t + i] in its
// low nibble and code[16p + n, 8t + 4 + i] in its high one (n < 16, i < 4), so an and (and a shift) gives
// the unsigned-byte operand of vpdpbusd for 16 channels x 4 features. Scales and minima as int4_linear's,
// in fp16 (GGUF Q4_1's precision for them): 0.625 bytes a weight, as Q4_1, where fp32 ones made it 0.75.
//
// x is quantized per group of G features of a row to int8 (quantize_rows.h on the groups, qmax 127:
// s = max |x_group| / 127, q = round_half_even(x / s); a group with a NaN or an infinity gives NaN outputs),
// as llama.cpp's Q8_1 activations for its Q4_1 dot product; then
// y[m, n] = sum_g (sum_{k in g} code q) * (s_mg * scale_ng) + min_ng * (sum_{k in g} x_mk, in fp32) (+ bias).
// The integer sums are exact (at most 32 * 15 * 127 a group lane for G = 32: int32 for any G < 2^20).
// A tile is up to kMR rows x 16 channels; rows go in blocks whose codes stay in L2, each thread takes whole
// panels of a block. Prefill too: at 129-2,048 rows 3-5x faster than dequantizing into the fp32 GEMM (as
// int4_linear does past 128 rows; bench/RESULTS.md, session 21), so prefill and decode round alike.
// Without AVX512-VNNI the same sums in a scalar loop (correct, slow: linear.py routes here only where the
// CPU has VNNI).
#include <torch/extension.h>
#include "quantize_rows.h"
#include "scalar_types.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using namespace heterollm_cpu;

constexpr int64_t kNR = 16;                // output channels per panel
constexpr int64_t kMR = 4;                 // rows per tile
constexpr int64_t kBlockBytes = 256 * 1024;  // the int8 codes of one row block (kept in L2)
// software prefetch (prefetches never fault past an array's end): the codes 16 lines ahead, the scales and
// minima 8 groups ahead; 6-9% of a one-row pass over SmolLM2's layers, where three streams per panel
// (codes, scales, minima) keep the hardware prefetchers below the read bandwidth (session 21)
constexpr int64_t kPrefetchBytes = 1024;

inline int32_t quad_at(const int8_t* q, int64_t i) {
  int32_t v;
  std::memcpy(&v, q + i, sizeof(v));
  return v;
}

// c[MR][16] for rows q (int8, stride k) with per-group scales sx and sums xsum (stride groups) against one
// panel b (octet-rows of 64 bytes), its scales sc and minima mn (groups x 16)
template <int MR>
void tile(const int8_t* q, int64_t k, const float* sx, const float* xsum, int64_t groups, int64_t goct,
          const uint8_t* b, const at::Half* sc, const at::Half* mn, float* c) {
#if HETEROLLM_VNNI
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 f[MR];
  for (int m = 0; m < MR; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i lo[MR], hi[MR];  // two chains a row: the low and the high nibbles' features
    for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
    for (int64_t t = g * goct, end = (g + 1) * goct; t < end; ++t) {
      _mm_prefetch(reinterpret_cast<const char*>(b + t * 64 + kPrefetchBytes), _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(b + t * 64);
      const __m512i wl = _mm512_and_si512(raw, nibble);
      const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      for (int m = 0; m < MR; ++m) {
        const int8_t* row = q + m * k + 8 * t;
        lo[m] = _mm512_dpbusd_epi32(lo[m], wl, _mm512_set1_epi32(quad_at(row, 0)));
        hi[m] = _mm512_dpbusd_epi32(hi[m], wh, _mm512_set1_epi32(quad_at(row, 4)));
      }
    }
    _mm_prefetch(reinterpret_cast<const char*>(sc + (g + 8) * kNR), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(mn + (g + 8) * kNR), _MM_HINT_T0);
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * kNR)));
    const __m512 l = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + g * kNR)));
    for (int m = 0; m < MR; ++m) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo[m], hi[m]));
      f[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(sx[m * groups + g])), f[m]);
      f[m] = _mm512_fmadd_ps(l, _mm512_set1_ps(xsum[m * groups + g]), f[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(c + m * kNR, f[m]);
#else
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < kNR; ++n) {
      float out = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int64_t t = g * goct; t < (g + 1) * goct; ++t) {
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = b[t * 64 + 4 * n + i];
            dot += int32_t(byte & 0x0F) * q[m * k + 8 * t + i] + int32_t(byte >> 4) * q[m * k + 8 * t + 4 + i];
          }
        }
        out += static_cast<float>(dot) * (static_cast<float>(sc[g * kNR + n]) * sx[m * groups + g]);
        out += static_cast<float>(mn[g * kNR + n]) * xsum[m * groups + g];
      }
      c[m * kNR + n] = out;
    }
  }
#endif
}

// y = x w^T (+ bias) from the activation codes q (rows, k), their group scales sx and the groups' sums of x
// xsum (rows, groups): row blocks in turn, the panels of a block split across threads
template <typename S>
void gemm(const int8_t* q, const float* sx, const float* xsum, const uint8_t* panels, const at::Half* scales,
          const at::Half* mins, const typename S::T* bias, int64_t rows, int64_t k, int64_t group, int64_t n,
          typename S::T* y) {
  const int64_t groups = k / group, npanels = (n + kNR - 1) / kNR;
  const int64_t block = std::max<int64_t>(kMR, kBlockBytes / k / kMR * kMR);
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t r1 = std::min(rows, r0 + block);
    at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
      alignas(64) float c[kMR * kNR];
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* b = panels + p * (k / 8) * 64;
        const at::Half* sc = scales + p * groups * kNR;
        const at::Half* mn = mins + p * groups * kNR;
        const int64_t n0 = p * kNR, nn = std::min(kNR, n - n0);
        for (int64_t m0 = r0; m0 < r1; m0 += kMR) {
          const int64_t mr = std::min(kMR, r1 - m0);
          const int8_t* a = q + m0 * k;
          const float *s = sx + m0 * groups, *xs = xsum + m0 * groups;
          switch (mr) {
            case 1: tile<1>(a, k, s, xs, groups, group / 8, b, sc, mn, c); break;
            case 2: tile<2>(a, k, s, xs, groups, group / 8, b, sc, mn, c); break;
            case 3: tile<3>(a, k, s, xs, groups, group / 8, b, sc, mn, c); break;
            default: tile<4>(a, k, s, xs, groups, group / 8, b, sc, mn, c); break;
          }
          for (int64_t m = 0; m < mr; ++m) {
            typename S::T* out = y + (m0 + m) * n + n0;
            int64_t j = 0;
#if HETEROLLM_VNNI
            if (nn == kNR) {
              const __m512 v = _mm512_loadu_ps(c + m * kNR);
              store16(out, bias != nullptr ? _mm512_add_ps(v, load16(bias + n0)) : v);
              j = kNR;
            }
#endif
            for (; j < nn; ++j) {
              const float v = c[m * kNR + j];
              S::store(out, j, bias != nullptr ? v + S::load(bias, n0 + j) : v);
            }
          }
        }
      }
    });
  }
}

// the sum of x over each group of each row, in fp32: xsum (rows, groups)
template <typename S>
void group_sums(const typename S::T* x, int64_t rows, int64_t k, int64_t group, float* xsum) {
  const int64_t total = rows * (k / group);
  at::parallel_for(0, total, std::max<int64_t>(1, (int64_t{1} << 14) / group), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float t = 0.f;
      for (int64_t f = 0; f < group; ++f) t += S::load(x, i * group + f);
      xsum[i] = t;
    }
  });
}

template <typename S>
void run(const at::Tensor& x2, const at::Tensor& b, const uint8_t* panels, const at::Half* scales,
         const at::Half* mins, int64_t group, int64_t n, at::Tensor& y) {
  const int64_t rows = x2.size(0), k = x2.size(1), groups = k / group;
  auto q = torch::empty({rows, k}, x2.options().dtype(torch::kChar));
  auto sx = torch::empty({rows * groups}, x2.options().dtype(torch::kFloat));
  auto xsum = torch::empty({rows * groups}, x2.options().dtype(torch::kFloat));
  // each group of a row quantized on its own: the rows of quantize_rows are the groups
  quantize_rows_of(x2.view({rows * groups, group}), group, 127, q.data_ptr<int8_t>(), sx.data_ptr<float>());
  using T = typename S::T;
  group_sums<S>(reinterpret_cast<const T*>(x2.data_ptr()), rows, k, group, xsum.data_ptr<float>());
  gemm<S>(q.data_ptr<int8_t>(), sx.data_ptr<float>(), xsum.data_ptr<float>(), panels, scales, mins,
          b.defined() ? reinterpret_cast<const T*>(b.data_ptr()) : nullptr, rows, k, group, n,
          reinterpret_cast<T*>(y.data_ptr()));
}

torch::Tensor int4_dot_linear(torch::Tensor x, torch::Tensor panels, torch::Tensor scales, torch::Tensor mins,
                              int64_t group, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(panels.scalar_type() == torch::kByte && panels.dim() == 3 && panels.size(2) == 64,
              "panels must be (P, K / 8, 64) uint8");
  TORCH_CHECK(panels.is_contiguous(), "panels must be contiguous");
  const int64_t npanels = panels.size(0), k = 8 * panels.size(1);
  TORCH_CHECK(x.size(-1) == k, "x's last dimension (", x.size(-1), ") does not match the panels' ", k, " features");
  TORCH_CHECK(group > 0 && group % 8 == 0 && k % group == 0, "the group size must be a multiple of 8 and divide K");
  TORCH_CHECK(n > 0 && npanels == (n + kNR - 1) / kNR, "panels hold ", npanels, " panels of 16, not ", n, " channels");
  for (const auto& [t, name] : {std::pair{scales, "scales"}, std::pair{mins, "mins"}}) {
    TORCH_CHECK(t.scalar_type() == torch::kHalf && t.is_contiguous() &&
                    t.sizes() == torch::IntArrayRef({npanels, k / group, kNR}),
                name, " must be contiguous (P, K / group, 16) float16");
  }
  const auto [x2, out_shape] = as_rows(x, n);
  const torch::Tensor b = checked_bias(bias, x, n);
  auto y = torch::empty({x2.size(0), n}, x.options());
  if (x2.size(0) == 0) return y.view(out_shape);
  const uint8_t* bp = panels.data_ptr<uint8_t>();
  const at::Half *sp = scales.data_ptr<at::Half>(), *lp = mins.data_ptr<at::Half>();
  if (x.scalar_type() == torch::kBFloat16) {
    run<BF16>(x2, b, bp, sp, lp, group, n, y);
  } else {
    run<F32>(x2, b, bp, sp, lp, group, n, y);
  }
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("int4_dot_linear(Tensor x, Tensor panels, Tensor scales, Tensor mins, int group, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("int4_dot_linear", &int4_dot_linear); }
