// Fused elementwise ops for the CPU backend: each replaces a chain of small torch ops (one pass over
// memory instead of 4-8, one dispatch instead of 4-8) for the op registry's `rms_norm`,
// `silu_and_mul` and `rotary_embedding` (heterollm.model_executor.ops has their torch definitions,
// which stay the reference). Built with paged_decode.cpp by heterollm_cpu/kernels.py.
//
// They compute what those definitions compute, rounding where they round: math in fp32, and for a
// bf16 tensor the intermediate that torch rounds to bf16 is rounded here too (RMSNorm's normalized
// x before the weight, SiLU's output before the product), round-to-nearest-even as c10 does. Only
// the order of RMSNorm's sum differs (a few fp32 ulps).
//
// rms_norm(x (..., H), weight (H), eps) -> (..., H) contiguous
// silu_and_mul(gate (N, I), up (N, I)) -> (N, I): silu(gate) * up; gate and up may be the two halves
//   of one (N, 2I) tensor (row stride 2I)
// rotary_embedding(x (T, NH, D), cos (T, D/2) fp32, sin (T, D/2) fp32) -> (T, NH, D) contiguous,
//   rotate-half (Neox) layout: [x1 c - x2 s, x2 c + x1 s] with x1, x2 the halves of each head
// x: fp32 or bf16 with a contiguous last dimension; any stride elsewhere.
#include <torch/extension.h>
#include "scalar_types.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace heterollm_cpu;

// A tensor of rows: the last dimension contiguous, the others flattened to row indices by their
// strides (2 or 3 dimensions; a view of a wider tensor, such as q/k heads inside a fused qkv output).
struct Rows {
  int64_t n0 = 1, n1 = 1, s0 = 0, s1 = 0, width = 0;
  int64_t count() const { return n0 * n1; }
  int64_t offset(int64_t r) const { return (r / n1) * s0 + (r % n1) * s1; }
};

Rows rows_of(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, name, " must have 2 or 3 dimensions, got ", x.dim());
  TORCH_CHECK(x.stride(-1) == 1, name, "'s last dimension must be contiguous");
  Rows r;
  r.width = x.size(-1);
  if (x.dim() == 2) {
    r.n1 = x.size(0);
    r.s1 = x.stride(0);
  } else {
    r.n0 = x.size(0);
    r.s0 = x.stride(0);
    r.n1 = x.size(1);
    r.s1 = x.stride(1);
  }
  return r;
}

void check_storage(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16, got ", x.scalar_type());
}

// rows per task: small batches (a decode step) stay on one thread, where a pool hand-off costs more
// than the work
int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

template <typename S>
void rms_norm_rows(const typename S::T* x, const Rows& rows, const typename S::T* w, float eps,
                   typename S::T* out) {
  const int64_t h = rows.width;
  at::parallel_for(0, rows.count(), grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const typename S::T* xr = x + rows.offset(r);
      typename S::T* o = out + r * h;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < h; ++i) {
        const float v = S::load(xr, i);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + eps);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) S::store(o, i, S::load(w, i) * S::round(S::load(xr, i) * inv));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_storage(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be (", x.size(-1), ",)");
  weight = weight.contiguous();
  const Rows rows = rows_of(x, "x");
  auto out = torch::empty(x.sizes(), x.options());
  if (x.scalar_type() == torch::kFloat) {
    rms_norm_rows<F32>(x.data_ptr<float>(), rows, weight.data_ptr<float>(), static_cast<float>(eps),
                       out.data_ptr<float>());
  } else {
    rms_norm_rows<BF16>(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows,
                        reinterpret_cast<const uint16_t*>(weight.data_ptr()), static_cast<float>(eps),
                        reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

template <typename S>
void silu_and_mul_rows(const typename S::T* g, const Rows& gr, const typename S::T* u, const Rows& ur,
                       typename S::T* out) {
  const int64_t n = gr.width;
  at::parallel_for(0, gr.count(), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const typename S::T* gp = g + gr.offset(r);
      const typename S::T* up = u + ur.offset(r);
      typename S::T* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float a = S::load(gp, i);
        S::store(o, i, S::round(a / (1.f + std::exp(-a))) * S::load(up, i));
      }
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate, torch::Tensor up) {
  check_storage(gate, "gate");
  TORCH_CHECK(up.scalar_type() == gate.scalar_type(), "up must have gate's dtype");
  TORCH_CHECK(gate.sizes() == up.sizes(), "gate and up must have the same shape");
  TORCH_CHECK(gate.dim() == 2, "gate and up must be (tokens, features)");
  const Rows gr = rows_of(gate, "gate"), ur = rows_of(up, "up");
  auto out = torch::empty(gate.sizes(), gate.options());
  if (gate.scalar_type() == torch::kFloat) {
    silu_and_mul_rows<F32>(gate.data_ptr<float>(), gr, up.data_ptr<float>(), ur, out.data_ptr<float>());
  } else {
    silu_and_mul_rows<BF16>(reinterpret_cast<const uint16_t*>(gate.data_ptr()), gr,
                            reinterpret_cast<const uint16_t*>(up.data_ptr()), ur,
                            reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

template <typename S>
void rotary_rows(const typename S::T* x, const Rows& rows, const float* cos, const float* sin, int64_t table_stride,
                 typename S::T* out) {
  const int64_t d = rows.width, half = d / 2, heads = rows.n1;
  at::parallel_for(0, rows.count(), grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const typename S::T* xr = x + rows.offset(r);
      typename S::T* o = out + r * d;
      const float* c = cos + (r / heads) * table_stride;
      const float* s = sin + (r / heads) * table_stride;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = S::load(xr, i), x2 = S::load(xr, i + half);
        S::store(o, i, x1 * c[i] - x2 * s[i]);
        S::store(o, i + half, x2 * c[i] + x1 * s[i]);
      }
    }
  });
}

torch::Tensor rotary_embedding(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_storage(x, "x");
  TORCH_CHECK(x.dim() == 3, "x must be (tokens, heads, head_dim)");
  TORCH_CHECK(x.size(-1) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat, "cos and sin must be float32");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(-1) / 2 && sin.sizes() == cos.sizes(),
              "cos and sin must be (tokens, head_dim / 2)");
  cos = cos.contiguous();
  sin = sin.contiguous();
  const Rows rows = rows_of(x, "x");
  auto out = torch::empty(x.sizes(), x.options());
  if (x.scalar_type() == torch::kFloat) {
    rotary_rows<F32>(x.data_ptr<float>(), rows, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(1),
                     out.data_ptr<float>());
  } else {
    rotary_rows<BF16>(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, cos.data_ptr<float>(),
                      sin.data_ptr<float>(), cos.size(1), reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
