// The CPU backend's W8A8 linear (`--quantization w8a8`): int8 weights with one scale per output
// channel, activations quantized to int8 per row (per token) at each call, an int8 x int8 -> int32
// GEMM (torch's _int_mm: oneDNN's s8s8 kernel, AVX512-VNNI / AVX-VNNI / AMX-int8 where the CPU has
// them), then the two scales applied. One dispatch from Python for the three steps.
//
// w8a8_linear(x (..., K) fp32 or bf16, codes (N, K) int8, w_scale (N) fp32, bias (N) or None)
//   -> (..., N) in x's dtype
// Row m of x: amax = max |x[m, :]| (in fp32), q = round_half_even(x * (127 / amax)) in [-127, 127],
// s = amax * (1 / 127) in fp32 (a row of zeros, or of values under 127 / FLT_MAX: q = 0, s = 1; a row
// with a NaN or an infinity: q = 0, s = NaN, so its outputs are NaN). Then y[m, n] = acc[m, n] * (s[m] * w_scale[n]) (+ bias[n]),
// rounded to x's dtype. linear.py's torch path computes the same, operation for operation: the same
// codes and integer sums; -ffast-math may reorder the two scale products and fuse the bias into an
// FMA, an ulp or two of the output. AVX-512 loops where the CPU has them (16 values at a time), the
// int32 sums made and scaled 256 rows at a time so they stay in cache.
#include <torch/extension.h>
#include "quantize_rows.h"
#include "scalar_types.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kChunkRows = 256;

using namespace heterollm_cpu;

template <typename S>
void dequantize_rows(const int32_t* acc, const float* row_scale, const float* w_scale, const typename S::T* bias,
                     int64_t rows, int64_t n, typename S::T* y) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int32_t* a = acc + m * n;
      const float s = row_scale[m];
      typename S::T* out = y + m * n;
      int64_t j = 0;
#if defined(__AVX512F__)
      const __m512 vs = _mm512_set1_ps(s);
      for (; j + 16 <= n; j += 16) {
        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + j)),
                                            _mm512_mul_ps(vs, _mm512_loadu_ps(w_scale + j)));
        store16(out + j, bias != nullptr ? _mm512_add_ps(scaled, load16(bias + j)) : scaled);
      }
#endif
      if (bias != nullptr) {
        for (; j < n; ++j) S::store(out, j, static_cast<float>(a[j]) * (s * w_scale[j]) + S::load(bias, j));
      } else {
        for (; j < n; ++j) S::store(out, j, static_cast<float>(a[j]) * (s * w_scale[j]));
      }
    }
  });
}

torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor w_scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(codes.scalar_type() == torch::kChar && codes.dim() == 2, "codes must be (N, K) int8");
  TORCH_CHECK(x.size(-1) == codes.size(1), "x's last dimension must be codes' K");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat && w_scale.numel() == codes.size(0), "w_scale must be (N) float32");
  const int64_t k = codes.size(1), n = codes.size(0);
  const auto [x2, out_shape] = as_rows(x, n);
  const int64_t rows = x2.size(0);
  if (rows == 0) return torch::empty(out_shape, x.options());
  auto q = torch::empty({rows, k}, x.options().dtype(torch::kChar));
  auto row_scale = torch::empty({rows}, x.options().dtype(torch::kFloat));
  auto ws = w_scale.contiguous();
  const torch::Tensor b = checked_bias(bias, x, n);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  quantize_rows_of(x2, k, 127, q.data_ptr<int8_t>(), row_scale.data_ptr<float>());
  auto y = torch::empty({rows, n}, x.options());
  // the int32 sums of CHUNK rows at a time, scaled while they are still in cache: a prefill's whole
  // (rows, N) int32 product would go out to memory and back
  const int64_t chunk = std::min<int64_t>(rows, kChunkRows);
  auto acc = torch::empty({chunk, n}, x.options().dtype(torch::kInt));
  const auto wt = codes.t();  // the (N, K) weight read as its transpose
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t r = std::min(chunk, rows - r0);
    auto part = acc.narrow(0, 0, r);
    at::_int_mm_out(part, q.narrow(0, r0, r), wt);
    const float* rs = row_scale.data_ptr<float>() + r0;
    if (bf16) {
      dequantize_rows<BF16>(part.data_ptr<int32_t>(), rs, ws.data_ptr<float>(),
                            b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr, r, n,
                            reinterpret_cast<uint16_t*>(y.data_ptr()) + r0 * n);
    } else {
      dequantize_rows<F32>(part.data_ptr<int32_t>(), rs, ws.data_ptr<float>(),
                           b.defined() ? b.data_ptr<float>() : nullptr, r, n, y.data_ptr<float>() + r0 * n);
    }
  }
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("w8a8_linear(Tensor x, Tensor codes, Tensor w_scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
