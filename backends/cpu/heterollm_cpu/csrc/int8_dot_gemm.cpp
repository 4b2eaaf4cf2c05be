// `--quantization w8a8` on CPUs with AVX512-VNNI (AMD Zen 4 on, Intel Ice Lake on): an int8 x int8 GEMM on
// prepacked weights with the 4-way byte dot product (vpdpbusd), where torch's _int_mm (oneDNN's s8s8
// GEMM) re-reads the plain (N, K) codes for each call: measured on 2 AMD EPYC (Zen 4) vCPUs over
// SmolLM2-135M's layer shapes, bench/RESULTS.md.
//
// int8_dot_gemm(x (..., K) fp32 or bf16, panels (P, ceil(K / 4), 16, 4) int8, w_scale (N) fp32,
//               w_sums (N) int32, bias (N) in x's dtype or None) -> (..., N) in x's dtype
// panels: the (N, K) int8 codes in panels of 16 output channels (N padded with zero rows to 16 P), K padded
// with zero columns to a multiple of 4, each quad of input features of the 16 channels stored together
// (linear.py's `pack_int8_quads`): one 64-byte row per quad, byte 4n + i = w[16p + n, 4j + i].
// w_sums[n] = 128 * sum_k w[n, k].
// Row m of x is quantized as w8a8_linear does (quantize_rows.h, qmax 127): s_m = max |x_m| / 127,
// q = round_half_even(x_m / s_m) (a row of zeros: q = 0, s = 1; a NaN or an infinity: q = 0, s = NaN).
// vpdpbusd multiplies unsigned bytes by signed ones, so the kernel stores u = q + 128 (in [1, 255]) and
// subtracts 128 * sum_k w[n, k] from the sums: sum_k q w = sum_k u w - w_sums[n].
// y[m, n] = (sum_k q[m, k] w[n, k]) * (s_m * w_scale[n]) (+ bias[n]): the integer sums are _int_mm's
// exactly (int32 over up to kChunkQuads quads; a wider K adds the int32 sums of each chunk in fp32), the
// scaling w8a8_linear's. A tile is up to kMR rows x 16 channels, one 512-bit int32 accumulator a row;
// rows go in blocks that stay in L2, each thread takes whole panels of a block. A thread prefetches its next
// panel while the current one's tiles run, a share per tile: at 12-48 rows a panel's tiles take about as
// long as reading the next one from memory, and without it the first tile waited for its panel while the
// others left memory idle (1.09-1.26x at 12-48 rows on 2 Zen 4 vCPUs, bench/RESULTS.md). Without AVX512-VNNI the
// same sums in a scalar loop (correct, slow: linear.py routes there only where the CPU has VNNI).
#include <torch/extension.h>
#include "quantize_rows.h"
#include "scalar_types.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using namespace heterollm_cpu;

constexpr int64_t kNR = 16;                   // output channels per panel
constexpr int64_t kMR = 8;                    // rows per tile
constexpr int64_t kChunkQuads = 16384;        // 16384 * 4 * 255 * 127 < 2^31: exact int32 sums per chunk
constexpr int64_t kBlockBytes = 256 * 1024;   // the quantized rows of one row block (kept in L2)

// c[MR][16] = sum over quads of rows u (uint8, stride lda) with the panel b, minus wsum, in fp32
template <int MR>
void tile(const uint8_t* u, int64_t lda, const int8_t* b, int64_t quads, const int32_t* wsum, float* c,
          const int8_t* pf, int64_t pf_lines) {
#if HETEROLLM_VNNI
  // pf: pf_lines lines of the next panel to prefetch, spread over this tile's quads
  const int64_t pf_every = pf_lines > 0 ? std::max<int64_t>(1, quads / pf_lines) : quads + 1;
  int64_t pf_countdown = pf_every, pf_done = 0;
  __m512 f[MR];
  for (int m = 0; m < MR; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < quads; j0 += kChunkQuads) {
    __m512i acc[MR];
    const __m512i init = j0 == 0 ? _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(wsum))
                                 : _mm512_setzero_si512();
    for (int m = 0; m < MR; ++m) acc[m] = init;
    for (int64_t j = j0, j1 = std::min(quads, j0 + kChunkQuads); j < j1; ++j) {
      const __m512i w = _mm512_loadu_si512(b + j * 64);
      if (--pf_countdown == 0) {
        pf_countdown = pf_every;
        if (pf_done < pf_lines) _mm_prefetch(reinterpret_cast<const char*>(pf + 64 * pf_done++), _MM_HINT_T0);
      }
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, u + m * lda + 4 * j, sizeof(quad));
        acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_set1_epi32(quad), w);
      }
    }
    for (int m = 0; m < MR; ++m) f[m] = _mm512_add_ps(f[m], _mm512_cvtepi32_ps(acc[m]));
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(c + m * kNR, f[m]);
#else
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < kNR; ++n) {
      float total = 0.f;
      for (int64_t j0 = 0; j0 < quads; j0 += kChunkQuads) {
        int32_t acc = j0 == 0 ? -wsum[n] : 0;
        for (int64_t j = j0, j1 = std::min(quads, j0 + kChunkQuads); j < j1; ++j)
          for (int i = 0; i < 4; ++i) acc += int32_t(u[m * lda + 4 * j + i]) * int32_t(b[j * 64 + 4 * n + i]);
        total += static_cast<float>(acc);
      }
      c[m * kNR + n] = total;
    }
  }
#endif
}

template <typename S>
void gemm(const uint8_t* u, const float* sx, const int8_t* panels, const float* sw, const int32_t* wsum,
          const typename S::T* bias, int64_t rows, int64_t kp, int64_t n, typename S::T* y) {
  const int64_t quads = kp / 4, npanels = (n + kNR - 1) / kNR;
  const int64_t block = std::max<int64_t>(kMR, kBlockBytes / kp / kMR * kMR);
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t r1 = std::min(rows, r0 + block);
    at::parallel_for(0, npanels, 1, [&](int64_t p0, int64_t p1) {
      alignas(64) float c[kMR * kNR];
      alignas(64) int32_t ws[kNR];
      const int64_t tiles = (r1 - r0 + kMR - 1) / kMR;
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* b = panels + p * quads * 64;
        // the next panel (this thread's) is read while this one's tiles run: each tile prefetches its share
        const int8_t* next = p + 1 < p1 ? b + quads * 64 : nullptr;
        const int64_t share = next ? (quads + tiles - 1) / tiles : 0;
        const int64_t n0 = p * kNR, nn = std::min(kNR, n - n0);
        std::fill(ws, ws + kNR, 0);
        std::copy(wsum + n0, wsum + n0 + nn, ws);
        for (int64_t m0 = r0; m0 < r1; m0 += kMR) {
          const int64_t mr = std::min(kMR, r1 - m0);
          const uint8_t* a = u + m0 * kp;
          const int64_t t = (m0 - r0) / kMR;
          const int8_t* pf = next ? next + 64 * std::min(quads, t * share) : nullptr;
          const int64_t pf_lines = next ? std::max<int64_t>(0, std::min(share, quads - t * share)) : 0;
          switch (mr) {
            case 1: tile<1>(a, kp, b, quads, ws, c, pf, pf_lines); break;
            case 2: tile<2>(a, kp, b, quads, ws, c, pf, pf_lines); break;
            case 3: tile<3>(a, kp, b, quads, ws, c, pf, pf_lines); break;
            case 4: tile<4>(a, kp, b, quads, ws, c, pf, pf_lines); break;
            case 5: tile<5>(a, kp, b, quads, ws, c, pf, pf_lines); break;
            case 6: tile<6>(a, kp, b, quads, ws, c, pf, pf_lines); break;
            case 7: tile<7>(a, kp, b, quads, ws, c, pf, pf_lines); break;
            default: tile<8>(a, kp, b, quads, ws, c, pf, pf_lines); break;
          }
          for (int64_t m = 0; m < mr; ++m) {
            const float s = sx[m0 + m];
            typename S::T* out = y + (m0 + m) * n + n0;
            int64_t j = 0;
#if HETEROLLM_VNNI
            if (nn == kNR) {
              const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(c + m * kNR),
                                             _mm512_mul_ps(_mm512_set1_ps(s), _mm512_loadu_ps(sw + n0)));
              store16(out, bias != nullptr ? _mm512_add_ps(v, load16(bias + n0)) : v);
              j = kNR;
            }
#endif
            for (; j < nn; ++j) {
              const float v = c[m * kNR + j] * (s * sw[n0 + j]);
              S::store(out, j, bias != nullptr ? v + S::load(bias, n0 + j) : v);
            }
          }
        }
      }
    });
  }
}

torch::Tensor int8_dot_gemm(torch::Tensor x, torch::Tensor panels, torch::Tensor w_scale, torch::Tensor w_sums,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(panels.scalar_type() == torch::kChar && panels.dim() == 4 && panels.size(2) == kNR && panels.size(3) == 4,
              "panels must be (P, ceil(K / 4), 16, 4) int8");
  TORCH_CHECK(panels.is_contiguous(), "panels must be contiguous");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat && w_scale.dim() == 1, "w_scale must be (N) float32");
  TORCH_CHECK(w_sums.scalar_type() == torch::kInt && w_sums.dim() == 1 && w_sums.numel() == w_scale.numel(),
              "w_sums must be (N) int32, like w_scale");
  const int64_t k = x.size(-1), n = w_scale.numel(), kp = 4 * panels.size(1);
  TORCH_CHECK(kp == (k + 3) / 4 * 4, "x's last dimension (", k, ") does not match the panels' ", kp, " features");
  TORCH_CHECK(panels.size(0) == (n + kNR - 1) / kNR, "panels hold ", panels.size(0), " panels of 16, w_scale ", n,
              " channels");
  const auto [x2, out_shape] = as_rows(x, n);
  const int64_t rows = x2.size(0);
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y.view(out_shape);
  auto q = torch::empty({rows, kp}, x.options().dtype(torch::kChar));
  auto sx = torch::empty({rows}, x.options().dtype(torch::kFloat));
  auto ws = w_scale.contiguous();
  auto wsum = w_sums.contiguous();
  const torch::Tensor b = checked_bias(bias, x, n);
  quantize_rows_of(x2, kp, 127, q.data_ptr<int8_t>(), sx.data_ptr<float>());
  // q + 128 as unsigned bytes (the padding columns too: their weights are zero)
  uint8_t* u = reinterpret_cast<uint8_t*>(q.data_ptr<int8_t>());
  const int64_t total = rows * kp;
  at::parallel_for(0, total, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) u[i] ^= 0x80;
  });
  if (x.scalar_type() == torch::kBFloat16) {
    gemm<BF16>(u, sx.data_ptr<float>(), panels.data_ptr<int8_t>(), ws.data_ptr<float>(), wsum.data_ptr<int32_t>(),
               b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr, rows, kp, n,
               reinterpret_cast<uint16_t*>(y.data_ptr()));
  } else {
    gemm<F32>(u, sx.data_ptr<float>(), panels.data_ptr<int8_t>(), ws.data_ptr<float>(), wsum.data_ptr<int32_t>(),
              b.defined() ? b.data_ptr<float>() : nullptr, rows, kp, n, y.data_ptr<float>());
  }
  return y.view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("int8_dot_gemm(Tensor x, Tensor panels, Tensor w_scale, Tensor w_sums, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("int8_dot_gemm", &int8_dot_gemm); }
