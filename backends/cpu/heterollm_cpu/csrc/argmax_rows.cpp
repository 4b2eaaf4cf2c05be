// Greedy sampling's argmax for the CPU backend: argmax_rows(logits (R, V) fp32 or bf16) -> (R,) int64, the
// index of each row's largest value, the first of equal ones; a row holding a NaN gives its first NaN's
// index. That is torch.argmax(logits.float(), -1), without the fp32 copy of the logits (a bf16 value
// widens to fp32 exactly, so the order is the same) and vectorized: torch's argmax over a row read 64 x
// 49,152 fp32 logits at ~6 GB/s on 2 Zen 4 vCPUs, its amax at ~150 GB/s (bench/RESULTS.md, session 23).
// Rows go to threads whole. The NaN test is on the bits (-ffast-math may drop a floating-point one).
#include <torch/extension.h>
#include "quantize_rows.h"  // load16 (AVX-512), and through scalar_types.h bf16_to_float
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {

using namespace heterollm_cpu;

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}
inline float value_at(const float* x, int64_t i) { return x[i]; }
inline float value_at(const uint16_t* x, int64_t i) { return bf16_to_float(x[i]); }
inline bool is_nan_bits(float v) { return (bits_of(v) & 0x7FFFFFFFu) > 0x7F800000u; }

// the scalar loop: elements begin .. n - 1 against (best, at), which the caller has set
template <typename T>
int64_t finish_scalar(const T* x, int64_t begin, int64_t n, float best, int64_t at) {
  for (int64_t i = begin; i < n; ++i) {
    const float v = value_at(x, i);
    if (v > best) {
      best = v;
      at = i;
    }
  }
  return at;
}

template <typename T>
int64_t first_nan(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (is_nan_bits(value_at(x, i))) return i;
  return -1;
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0;
  float best = value_at(x, 0);
  int64_t at = 0;
#if defined(__AVX512F__)
  if (n >= 32) {
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
    __m512 vmax = load16(x);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = vidx;
    const __mmask16 nan0 = _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(vmax), magnitude), inf);
    __mmask16 nan = nan0;
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = load16(x + i);
      cur = _mm512_add_epi32(cur, step);
      nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), magnitude), inf);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);  // strict: a lane keeps its first
      vmax = _mm512_mask_blend_ps(gt, vmax, v);
      vidx = _mm512_mask_blend_epi32(gt, vidx, cur);
    }
    if (nan) return first_nan(x, n);
    best = _mm512_reduce_max_ps(vmax);
    // the lanes holding the maximum: the smallest index among them is the first occurrence so far
    const __mmask16 top = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best), _CMP_EQ_OQ);
    at = _mm512_mask_reduce_min_epi32(top, vidx);
  }
#endif
  for (int64_t j = i; j < n; ++j)  // the tail (or the whole row): no NaN before i
    if (is_nan_bits(value_at(x, j))) return j;
  return finish_scalar(x, i == 0 ? 1 : i, n, best, at);
}

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "argmax_rows: logits must be (rows, vocab)");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat || logits.scalar_type() == torch::kBFloat16,
              "argmax_rows: logits must be float32 or bfloat16");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: an empty row has no argmax");
  const auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const char* base = static_cast<const char*>(x.data_ptr());
  const int64_t elem = x.element_size();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const void* row = base + r * ld * elem;
      o[r] = bf16 ? argmax_row(static_cast<const uint16_t*>(row), n) : argmax_row(static_cast<const float*>(row), n);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
