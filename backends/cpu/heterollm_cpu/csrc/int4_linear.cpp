// The CPU backend's 4-bit weight-only linear (`--quantization wint4`, linear.py's WeightOnlyInt4):
// asymmetric 4-bit codes in groups along the input features, w[n, k] = code[n, k] * scale[n, g] +
// min[n, g] with g = k / group (GGUF's Q4_1 for a group of 32), activations kept in fp32 / bf16.
//
// int4_linear(x (..., K) fp32 or bf16, codes (N, K / 2) uint8, scales (N, K / G) fp32,
//             mins (N, K / G) fp32, G, bias (N) in x's dtype or None) -> (..., N) in x's dtype
// The codes go in blocks of 32 input features, 16 bytes a block: byte j holds feature j in its low
// nibble and feature j + 16 in its high one (ggml's Q4_1 order). G is a multiple of 32.
//
// Up to kGemvRows rows (decode) the weight is read once and each row of x multiplied against it
// straight from the codes: per block the 32 codes widen to fp32 once for up to four rows of x,
// sum_k code * x is scaled by the block's scale, and sum_g min * sum_{k in g} x (the sums of x per group
// made once per call) added at the end. That reads half a byte per weight, an eighth of fp32's, and
// runs on AVX2 + FMA (every x86 CPU with AVX-512 has them too); elsewhere a scalar loop of the same
// arithmetic. More rows (prefill) dequantize the weight to fp32 chunk by chunk and multiply with
// at::mm (the fp32 GEMM), where the dequantization costs less than a few rows' worth of the product.
// The result is F.linear(x, w) up to fp32 summation order.
#include <torch/extension.h>
#include "scalar_types.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HETEROLLM_INT4_AVX2 1
#endif

namespace {

using namespace heterollm_cpu;

constexpr int64_t kBlock = 32;       // input features per 16 bytes of codes
constexpr int64_t kGemvRows = 32;    // above this many rows: dequantize + GEMM
constexpr int64_t kChunkBytes = 4 << 20;  // the fp32 weight chunk a GEMM call takes

// the 32 codes of one block as fp32, in feature order: q[0..7], q[8..15], q[16..23], q[24..31]
#if HETEROLLM_INT4_AVX2
inline void widen_block(const uint8_t* p, __m256 q[4]) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, nibble);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
  q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// y[m, n] for MT rows of x (fp32, row stride k) and output rows [n0, n1): sum_b scale_b * (code . x)_b
// + sum_g min_g * xsum[m, g]
template <int MT>
void gemv_tile(const float* x, const float* xsum, int64_t k, int64_t groups, int64_t blocks_per_group,
               const uint8_t* codes, const float* scales, const float* mins, int64_t n0, int64_t n1, float* y,
               int64_t y_stride) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (k / 2);
    const float* s = scales + n * groups;
    const float* lo = mins + n * groups;
    float out[MT];
#if HETEROLLM_INT4_AVX2
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0, b = 0; g < groups; ++g) {
      const __m256 scale = _mm256_set1_ps(s[g]);
      for (const int64_t end = b + blocks_per_group; b < end; ++b) {
        __m256 q[4];
        widen_block(c + b * 16, q);
        for (int m = 0; m < MT; ++m) {
          const float* xb = x + m * k + b * kBlock;
          const __m256 t0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(xb)));
          const __m256 t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(q[2], _mm256_loadu_ps(xb + 16)));
          acc[m] = _mm256_fmadd_ps(scale, _mm256_add_ps(t0, t1), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) out[m] = hsum(acc[m]);
#else
    for (int m = 0; m < MT; ++m) out[m] = 0.f;
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const uint8_t* cb = c + b * 16;
      const float scale = s[b / blocks_per_group];
      for (int m = 0; m < MT; ++m) {
        const float* xb = x + m * k + b * kBlock;
        float t = 0.f;
        for (int j = 0; j < 16; ++j) t += static_cast<float>(cb[j] & 0x0F) * xb[j] + static_cast<float>(cb[j] >> 4) * xb[j + 16];
        out[m] += scale * t;
      }
    }
#endif
    for (int m = 0; m < MT; ++m) {
      const float* xs = xsum + m * groups;
      float t = 0.f;
      for (int64_t g = 0; g < groups; ++g) t += lo[g] * xs[g];
      y[m * y_stride + n] = out[m] + t;
    }
  }
}

// rows [n0, n1) of the weight in fp32, (n1 - n0, k)
void dequantize(const uint8_t* codes, const float* scales, const float* mins, int64_t k, int64_t groups,
                int64_t blocks_per_group, int64_t n0, int64_t n1, float* w) {
  at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* c = codes + n * (k / 2);
      float* row = w + (n - n0) * k;
      for (int64_t b = 0; b < k / kBlock; ++b) {
        const int64_t g = n * groups + b / blocks_per_group;
        const uint8_t* cb = c + b * 16;
        float* out = row + b * kBlock;
#if HETEROLLM_INT4_AVX2
        __m256 q[4];
        widen_block(cb, q);
        const __m256 s = _mm256_set1_ps(scales[g]), lo = _mm256_set1_ps(mins[g]);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(q[i], s, lo));
#else
        for (int j = 0; j < 16; ++j) {
          out[j] = static_cast<float>(cb[j] & 0x0F) * scales[g] + mins[g];
          out[j + 16] = static_cast<float>(cb[j] >> 4) * scales[g] + mins[g];
        }
#endif
      }
    }
  });
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor mins,
                          int64_t group, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(codes.scalar_type() == torch::kByte && codes.dim() == 2, "codes must be (N, K / 2) uint8");
  TORCH_CHECK(group > 0 && group % kBlock == 0, "the group size must be a multiple of 32");
  const int64_t n = codes.size(0), k = codes.size(1) * 2;
  TORCH_CHECK(x.size(-1) == k, "x's last dimension must be twice codes' second");
  TORCH_CHECK(k % group == 0, "K must be a multiple of the group size");
  const int64_t groups = k / group;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.sizes() == torch::IntArrayRef({n, groups}),
              "scales must be (N, K / group) float32");
  TORCH_CHECK(mins.scalar_type() == torch::kFloat && mins.sizes() == torch::IntArrayRef({n, groups}),
              "mins must be (N, K / group) float32");
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  auto xf = x.reshape({-1, k}).to(torch::kFloat).contiguous();
  const int64_t rows = xf.size(0);
  if (rows == 0) return torch::empty(out_shape, x.options());
  auto c = codes.contiguous();
  auto s = scales.contiguous(), lo = mins.contiguous();
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *lp = lo.data_ptr<float>();
  const int64_t blocks_per_group = group / kBlock;
  auto y = torch::empty({rows, n}, x.options().dtype(torch::kFloat));
  float* yp = y.data_ptr<float>();
  if (rows <= kGemvRows) {
    const float* xp = xf.data_ptr<float>();
    std::vector<float> xsum(rows * groups, 0.f);  // (rows, groups): sum of x over each group
    for (int64_t i = 0; i < rows * groups; ++i) {
      const float* xg = xp + i * group;
      float t = 0.f;
      for (int64_t j = 0; j < group; ++j) t += xg[j];
      xsum[i] = t;
    }
    const float* xs = xsum.data();
    at::parallel_for(0, n, 8, [&](int64_t n0, int64_t n1) {
      for (int64_t m = 0; m < rows; m += 4) {
        const float* xm = xp + m * k;
        const float* xsm = xs + m * groups;
        float* ym = yp + m * n;
        switch (std::min<int64_t>(4, rows - m)) {
          case 4: gemv_tile<4>(xm, xsm, k, groups, blocks_per_group, cp, sp, lp, n0, n1, ym, n); break;
          case 3: gemv_tile<3>(xm, xsm, k, groups, blocks_per_group, cp, sp, lp, n0, n1, ym, n); break;
          case 2: gemv_tile<2>(xm, xsm, k, groups, blocks_per_group, cp, sp, lp, n0, n1, ym, n); break;
          default: gemv_tile<1>(xm, xsm, k, groups, blocks_per_group, cp, sp, lp, n0, n1, ym, n); break;
        }
      }
    });
  } else {
    const int64_t chunk = std::max<int64_t>(16, std::min<int64_t>(n, kChunkBytes / (k * 4)));
    auto w = torch::empty({chunk, k}, xf.options());
    for (int64_t n0 = 0; n0 < n; n0 += chunk) {
      const int64_t n1 = std::min(n, n0 + chunk);
      dequantize(cp, sp, lp, k, groups, blocks_per_group, n0, n1, w.data_ptr<float>());
      y.narrow(1, n0, n1 - n0).copy_(at::mm(xf, w.narrow(0, 0, n1 - n0).t()));
    }
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias must be (N)");
    y.add_(bias->to(torch::kFloat).view({1, n}));
  }
  return y.to(x.scalar_type()).view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int group, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("int4_linear", &int4_linear); }
