// The CPU backend's W8A8 linear (`--quantization w8a8`): int8 weights with one scale per output
// channel, activations quantized to int8 per row (per token) at each call, an int8 x int8 -> int32
// GEMM (torch's _int_mm: oneDNN's s8s8 kernel, AVX512-VNNI / AVX-VNNI / AMX-int8 where the CPU has
// them), then the two scales applied. One dispatch from Python for the three steps.
//
// w8a8_linear(x (..., K) fp32 or bf16, codes (N, K) int8, w_scale (N) fp32, bias (N) or None)
//   -> (..., N) in x's dtype
// Row m of x: amax = max |x[m, :]| (in fp32), q = round_half_even(x * (127 / amax)) in [-127, 127],
// s = amax * (1 / 127) in fp32 (a row of zeros: q = 0, s = 1). Then y[m, n] = acc[m, n] * (s[m] * w_scale[n]) (+ bias[n]),
// rounded to x's dtype. linear.py's torch path computes the same, operation for operation: the same
// bits without a bias; with one, the compiler may fuse the last product and sum into an FMA.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept a NaN (as c10::BFloat16)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

struct F32 {
  using T = float;
  static inline float load(const T* p, int64_t i) { return p[i]; }
  static inline void store(T* p, int64_t i, float v) { p[i] = v; }
};
struct BF16 {
  using T = uint16_t;
  static inline float load(const T* p, int64_t i) { return bf16_to_float(p[i]); }
  static inline void store(T* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
};

template <typename S>
void quantize_rows(const typename S::T* x, int64_t rows, int64_t k, int8_t* q, float* scale) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const typename S::T* row = x + m * k;
      float amax = 0.f;
      for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(S::load(row, i)));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      scale[m] = amax > 0.f ? amax * (1.f / 127.f) : 1.f;  // a product: -ffast-math turns / 127 into one anyway
      int8_t* out = q + m * k;
      for (int64_t i = 0; i < k; ++i) {
        float v = std::nearbyint(S::load(row, i) * inv);  // the default rounding mode: half to even
        out[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
      }
    }
  });
}

template <typename S>
void dequantize_rows(const int32_t* acc, const float* row_scale, const float* w_scale, const typename S::T* bias,
                     int64_t rows, int64_t n, typename S::T* y) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int32_t* a = acc + m * n;
      const float s = row_scale[m];
      typename S::T* out = y + m * n;
      if (bias != nullptr) {
        for (int64_t j = 0; j < n; ++j) S::store(out, j, static_cast<float>(a[j]) * (s * w_scale[j]) + S::load(bias, j));
      } else {
        for (int64_t j = 0; j < n; ++j) S::store(out, j, static_cast<float>(a[j]) * (s * w_scale[j]));
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
  auto x2 = x.reshape({-1, k}).contiguous();
  const int64_t rows = x2.size(0);
  auto out_shape = x.sizes().vec();
  out_shape.back() = n;
  if (rows == 0) return torch::empty(out_shape, x.options());
  auto q = torch::empty({rows, k}, x.options().dtype(torch::kChar));
  auto row_scale = torch::empty({rows}, x.options().dtype(torch::kFloat));
  auto ws = w_scale.contiguous();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, "bias must be (N) in x's dtype");
    b = bias->contiguous();
  }
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  if (bf16) {
    quantize_rows<BF16>(reinterpret_cast<const uint16_t*>(x2.data_ptr()), rows, k, q.data_ptr<int8_t>(),
                        row_scale.data_ptr<float>());
  } else {
    quantize_rows<F32>(x2.data_ptr<float>(), rows, k, q.data_ptr<int8_t>(), row_scale.data_ptr<float>());
  }
  auto acc = at::_int_mm(q, codes.t());  // (rows, N) int32; the (N, K) weight read as its transpose
  auto y = torch::empty({rows, n}, x.options());
  if (bf16) {
    dequantize_rows<BF16>(acc.data_ptr<int32_t>(), row_scale.data_ptr<float>(), ws.data_ptr<float>(),
                          b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr, rows, n,
                          reinterpret_cast<uint16_t*>(y.data_ptr()));
  } else {
    dequantize_rows<F32>(acc.data_ptr<int32_t>(), row_scale.data_ptr<float>(), ws.data_ptr<float>(),
                         b.defined() ? b.data_ptr<float>() : nullptr, rows, n, y.data_ptr<float>());
  }
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("w8a8_linear(Tensor x, Tensor codes, Tensor w_scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
