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
// straight from the codes, four rows of x per pass over a weight row, on AVX2 (every x86 CPU with
// AVX-512 has it too): x is put in int16 per block of 32 features (x ~ xq * dx, dx = the block's
// max |x| / 32767: each value kept to 1 / 65534 of its block's largest), the 32 codes of a block widen
// to int16 once, _mm256_madd_epi16 sums code * xq in int32, and that sum is scaled by dx and by the
// group's scale; sum_g min_g * sum_{k in g} x (the sums of x in fp32, made once per call) is added at
// the end. That reads half a byte per weight, an eighth of fp32's, in fewer instructions than widening
// the codes to fp32 (measured on one core of an AVX2 AMD EPYC, a 15360 x 576 layer at one row: 614
// against 894 us, 1.45x; at four rows 1.2x). Elsewhere a scalar loop of the same sums in fp32. More rows (prefill) dequantize the
// weight to fp32 chunk by chunk and multiply with at::mm (the fp32 GEMM), where the dequantization
// costs less than a few rows' worth of the product. The result is F.linear(x, w) to within x's int16
// rounding (~1e-4 of the output's size) on AVX2, fp32 summation order otherwise.
#include <torch/extension.h>
#include "scalar_types.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
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
// + sum_g min_g * xsum[m, g]; the scalar loop of a CPU without AVX2 (gemv_tile16 below is the AVX2 one)
template <int MT>
void gemv_tile(const float* x, const float* xsum, int64_t k, int64_t groups, int64_t blocks_per_group,
               const uint8_t* codes, const float* scales, const float* mins, int64_t n0, int64_t n1, float* y,
               int64_t y_stride) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (k / 2);
    const float* s = scales + n * groups;
    const float* lo = mins + n * groups;
    float out[MT];
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
    for (int m = 0; m < MT; ++m) {
      const float* xs = xsum + m * groups;
      float t = 0.f;
      for (int64_t g = 0; g < groups; ++g) t += lo[g] * xs[g];
      y[m * y_stride + n] = out[m] + t;
    }
  }
}

#if HETEROLLM_INT4_AVX2
// x in int16 per block of 32 features: x ~ xq * dx (dx = max |x| / 32767 over the block, so each value is
// kept to 1 / 65534 of its block's largest); xq (rows, k), dx (rows, k / 32)
void quantize_x16(const float* x, int64_t rows, int64_t k, int16_t* xq, float* dx) {
  for (int64_t i = 0; i < rows * (k / kBlock); ++i) {
    const float* xb = x + i * kBlock;
    __m256 amax = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int j = 0; j < kBlock; j += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(xb + j), abs_mask));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    dx[i] = top / 32767.f;
    const __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb), inv));
    const __m256i lo2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8), inv));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16), inv));
    const __m256i hi2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 24), inv));
    // packs works within 128-bit lanes: put the quarters back in feature order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kBlock),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, lo2), 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kBlock + 16),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(hi, hi2), 0xD8));
  }
}

// gemv_tile on int16 activations: per block the 32 codes widen to int16 once and _mm256_madd_epi16
// sums code * xq in int32 pairs (at most 4 * 15 * 32767 a lane), converted and scaled by dx, then by
// the group's scale
template <int MT>
void gemv_tile16(const int16_t* xq, const float* dx, const float* xsum, int64_t k, int64_t groups,
                 int64_t blocks_per_group, const uint8_t* codes, const float* scales, const float* mins, int64_t n0,
                 int64_t n1, float* y, int64_t y_stride) {
  const int64_t blocks = k / kBlock;
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (k / 2);
    const float* s = scales + n * groups;
    const float* lo = mins + n * groups;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0, b = 0; g < groups; ++g) {
      __m256 gacc[MT];
      for (int m = 0; m < MT; ++m) gacc[m] = _mm256_setzero_ps();
      for (const int64_t end = b + blocks_per_group; b < end; ++b) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + b * 16));
        const __m256i q0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, nibble));                     // features 0..15
        const __m256i q1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble));  // 16..31
        for (int m = 0; m < MT; ++m) {
          const __m256i* xb = reinterpret_cast<const __m256i*>(xq + m * k + b * kBlock);
          const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(q0, _mm256_loadu_si256(xb)),
                                             _mm256_madd_epi16(q1, _mm256_loadu_si256(xb + 1)));
          gacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx[m * blocks + b]), gacc[m]);
        }
      }
      const __m256 scale = _mm256_set1_ps(s[g]);
      for (int m = 0; m < MT; ++m) acc[m] = _mm256_fmadd_ps(scale, gacc[m], acc[m]);
    }
    for (int m = 0; m < MT; ++m) {
      const float* xs = xsum + m * groups;
      float t = 0.f;
      for (int64_t g = 0; g < groups; ++g) t += lo[g] * xs[g];
      y[m * y_stride + n] = hsum(acc[m]) + t;
    }
  }
}
#endif

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
    // the rows in tiles of four (the last one shorter), each output row's codes read once per tile
    auto tiles = [&](auto tile) {
      at::parallel_for(0, n, 8, [&](int64_t n0, int64_t n1) {
        for (int64_t m = 0; m < rows; m += 4) {
          switch (std::min<int64_t>(4, rows - m)) {
            case 4: tile(std::integral_constant<int, 4>{}, m, n0, n1); break;
            case 3: tile(std::integral_constant<int, 3>{}, m, n0, n1); break;
            case 2: tile(std::integral_constant<int, 2>{}, m, n0, n1); break;
            default: tile(std::integral_constant<int, 1>{}, m, n0, n1); break;
          }
        }
      });
    };
#if HETEROLLM_INT4_AVX2
    std::vector<int16_t> xq(rows * k);
    std::vector<float> dx(rows * (k / kBlock));
    quantize_x16(xp, rows, k, xq.data(), dx.data());
    tiles([&](auto mt, int64_t m, int64_t n0, int64_t n1) {
      gemv_tile16<decltype(mt)::value>(xq.data() + m * k, dx.data() + m * (k / kBlock), xs + m * groups, k, groups,
                                       blocks_per_group, cp, sp, lp, n0, n1, yp + m * n, n);
    });
#else
    tiles([&](auto mt, int64_t m, int64_t n0, int64_t n1) {
      gemv_tile<decltype(mt)::value>(xp + m * k, xs + m * groups, k, groups, blocks_per_group, cp, sp, lp, n0, n1,
                                     yp + m * n, n);
    });
#endif
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
