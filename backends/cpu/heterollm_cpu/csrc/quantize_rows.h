// Per-row symmetric quantization of activations, shared by the int8 linears (int8_linear.cpp's w8a8_linear,
// int8 codes for torch's _int_mm; int8_gemm.cpp, int16 codes for the AVX2 16-bit multiply-add), and the
// AVX-512 16-wide loads / stores their loops use, and the AVX2 multiply-add of those int16 codes against a
// panel of 16 output channels (int8_gemm.cpp, int4_linear.cpp). kernels.py hashes this header with the sources.
//
// quantize_rows<S>(x (rows, k), rows, k, ld, qmax, q (rows, ld), scale (rows)): per row m,
// amax = max |x[m, :]| (fp32), q = round_half_even(x * (qmax / amax)) in [-qmax, qmax], scale = amax * (1 / qmax);
// a row of zeros, or of values under qmax / FLT_MAX: q = 0, scale = 1; a row with a NaN or an infinity:
// q = 0, scale = NaN (its outputs are NaN, as F.linear's would be). Columns k..ld-1 of q are zero padding.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
// the byte dot product the int8 x int8 kernels use where the CPU has it (int8_dot_gemm.cpp, int4_dot_linear.cpp)
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define HETEROLLM_VNNI 1
#endif

#include "scalar_types.h"

namespace heterollm_cpu {

#if defined(__AVX512F__)
// 16 values at a time. Loads widen to fp32; the bf16 store rounds to nearest even with a NaN kept a
// NaN, in integer ops (the same bits as float_to_bf16, denormals included, which vcvtneps2bf16 would
// flush).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
}
#endif

template <typename S, typename Q>
void quantize_rows(const typename S::T* x, int64_t rows, int64_t k, int64_t ld, int64_t qmax, Q* q, float* scale) {
  static_assert(std::is_same_v<Q, int8_t> || std::is_same_v<Q, int16_t>, "int8 or int16 codes");
  constexpr bool f32 = std::is_same_v<typename S::T, float>;
  const float fq = static_cast<float>(qmax);
  const float tiny = fq / std::numeric_limits<float>::max();  // a smaller row would overflow qmax / amax
  uint32_t nan_bits = 0x7FC00000u;
  float nan;
  std::memcpy(&nan, &nan_bits, sizeof(nan));
  // at least 16 rows and 16K values a thread: a fork costs more than quantizing fewer (one decode row's groups)
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 14) / std::max<int64_t>(k, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const typename S::T* row = x + m * k;
      Q* out = q + m * ld;
      std::fill(out + k, out + ld, Q(0));
      float amax = 0.f;
      bool finite = true;  // tested on the bits: -ffast-math assumes no NaN or infinity in float compares
      int64_t i = 0;
#if defined(__AVX512F__)
      {
        __m512 vmax = _mm512_setzero_ps();
        __mmask16 special = 0;
        const __m512i exponent = _mm512_set1_epi32(0x7F800000);
        for (; i + 16 <= k; i += 16) {
          const __m512 v = load16(row + i);
          special |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exponent), exponent);
          vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        }
        amax = _mm512_reduce_max_ps(vmax);
        finite = special == 0;
      }
#elif defined(__AVX2__)
      if constexpr (f32) {
        __m256 vmax = _mm256_setzero_ps();
        __m256i special = _mm256_setzero_si256();
        const __m256i exponent = _mm256_set1_epi32(0x7F800000);
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        for (; i + 8 <= k; i += 8) {
          const __m256 v = _mm256_loadu_ps(row + i);
          special = _mm256_or_si256(special, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent),
                                                                exponent));
          vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, magnitude));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, vmax);
        for (float l : lanes) amax = std::max(amax, l);
        finite = _mm256_testz_si256(special, special);
      }
#endif
      for (; i < k; ++i) {
        const float v = S::load(row, i);
        uint32_t bits;
        std::memcpy(&bits, &v, sizeof(bits));
        finite = finite && (bits & 0x7F800000u) != 0x7F800000u;
        amax = std::max(amax, std::fabs(v));
      }
      if (!finite || !(amax > tiny)) {
        std::fill(out, out + k, Q(0));
        scale[m] = finite ? 1.f : nan;
        continue;
      }
      const float inv = fq / amax;
      scale[m] = amax * (1.f / fq);
      i = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<Q, int8_t>) {
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m512i hi = _mm512_set1_epi32(qmax), lo = _mm512_set1_epi32(-qmax);
        for (; i + 16 <= k; i += 16) {  // round half to even (the default rounding mode)
          __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + i), vinv));
          c = _mm512_max_epi32(_mm512_min_epi32(c, hi), lo);
          _mm_storeu_si128((__m128i*)(out + i), _mm512_cvtepi32_epi8(c));
        }
      }
#endif
#if defined(__AVX2__)
      if constexpr (f32 && std::is_same_v<Q, int16_t>) {
        const __m256 vinv = _mm256_set1_ps(inv);
        const __m256i hi = _mm256_set1_epi32(qmax), lo = _mm256_set1_epi32(-qmax);
        for (; i + 8 <= k; i += 8) {  // round half to even (the default rounding mode)
          __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + i), vinv));
          c = _mm256_max_epi32(_mm256_min_epi32(c, hi), lo);
          _mm_storeu_si128((__m128i*)(out + i),
                           _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
        }
      }
#endif
      for (; i < k; ++i) {
        const float v = std::nearbyint(S::load(row, i) * inv);  // the default rounding mode: half to even
        out[i] = static_cast<Q>(std::min(fq, std::max(-fq, v)));
      }
    }
  });
}

// quantize_rows on x2, (rows, k) contiguous fp32 or bf16
template <typename Q>
void quantize_rows_of(const at::Tensor& x2, int64_t ld, int64_t qmax, Q* q, float* scale) {
  if (x2.scalar_type() == at::kBFloat16) {
    quantize_rows<BF16>(reinterpret_cast<const uint16_t*>(x2.data_ptr()), x2.size(0), x2.size(1), ld, qmax, q, scale);
  } else {
    quantize_rows<F32>(x2.data_ptr<float>(), x2.size(0), x2.size(1), ld, qmax, q, scale);
  }
}

// A linear's input x (..., K) as contiguous rows (rows, K), and its output's shape (..., n)
inline std::pair<at::Tensor, std::vector<int64_t>> as_rows(const at::Tensor& x, int64_t n) {
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  return {x.reshape({-1, x.size(-1)}).contiguous(), out_shape};
}

#if defined(__AVX2__)
// acc[m][0 / 1] += the pair of int16 codes 2j, 2j + 1 of row m of a (row stride lda), broadcast, times b0 / b1:
// a panel's int16 weights of those two features for channels 0..7 / 8..15, interleaved by feature
// (_mm256_madd_epi16 adds the two products of each channel into its int32 lane)
template <int MR>
inline void madd_pair(const int16_t* a, int64_t lda, int64_t j, __m256i b0, __m256i b1, __m256i (&acc)[MR][2]) {
  for (int m = 0; m < MR; ++m) {
    int32_t pair;
    std::memcpy(&pair, a + m * lda + 2 * j, sizeof(pair));
    const __m256i av = _mm256_set1_epi32(pair);
    acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(av, b0));
    acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(av, b1));
  }
}
#endif

// A linear's optional bias: (N) in x's dtype, contiguous; undefined when absent.
inline at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& x, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, "bias must be (N) in x's dtype");
  return bias->contiguous();
}

}  // namespace heterollm_cpu
