// The unquantized bf16 linear on CPUs with AVX512_BF16 (AMD Zen 4 on, Intel Cooper Lake / Sapphire Rapids
// on): y = x w^T (+ bias) with the bf16 pair dot product (vdpbf16ps, fp32 sums), the weight packed once
// at load in panels of 16 output channels, one 64-byte row per pair of input features (linear.py's
// `pack_bf16_panels`): element 2c + i of pair-row t holds w[16p + c, 2t + i]. A tile is up to kMR rows x
// kNP panels; each x pair is broadcast against a panel row, so the sums need no reduction across lanes,
// and a thread reads its panels front to back: one sequential stream, which the hardware prefetchers
// follow at the memory's pace where the (N, K) row-major layout's many short rows and oneDNN's blocked
// layout reach about half of it at one row. Measured on 2 AMD EPYC (Zen 4) vCPUs over SmolLM2-135M's
// 121 layer shapes (bench/linear_kernels.py --dtype bfloat16, session 22): 1.95x oneDNN's prepacked
// bf16 GEMM at one row (35 GB/s), 1.5-1.6x at 2-4, 1.1-1.2x at 16-64, even at 512-2,048 (prefill).
//
// bf16_linear(x (..., K) bf16, panels (P, K / 2, 32) bf16, N, bias (N) or None) -> (..., N) bf16
// N is padded to panels of 16 with zero channels, whose outputs are never stored. Rows go in blocks of
// 256 KB of x, each thread taking whole panel pairs of a block and every row tile of the block against
// them while they are in L2. A tile of fewer than 4 accumulators runs two chains over alternate pairs
// (the sums' latency would bound one). While a block's tiles run against a panel pair, the thread
// prefetches its next pair, a share per tile: at 8-64 rows the tiles take about as long as reading the
// pair, and without it the first tile waited on memory while the others left it idle (1.2-1.5x at 8-32
// rows in session 23's runs). The products of two bf16 values are exact in fp32; the sums go in
// another order than oneDNN's, and the result is rounded to bf16 once (round to nearest even).
// Without AVX512_BF16 the same sums in a scalar loop (correct, slow: linear.py routes here only where the
// CPU has the instruction).
#include <torch/extension.h>
#include "bf16_dot.h"
#include "scalar_types.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using namespace heterollm_cpu;

constexpr int64_t kNR = 16;                  // output channels per panel
constexpr int64_t kMR = 4;                   // rows per tile (8 measured no faster)
constexpr int64_t kBlockBytes = 256 * 1024;  // x's rows of one row block
constexpr int64_t kNP = 2;                   // panels per tile

inline int32_t pair_at(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// y[m][16 * j + c] for MR rows x (stride ldx, K = 2 * k2 features) against NP panels b (stride pstride)
template <int MR, int NP>
void tile(const uint16_t* x, int64_t ldx, int64_t k2, const uint16_t* b, int64_t pstride, const float* bias,
          uint16_t* y, int64_t ldy, int64_t nvalid, const uint16_t* pf, int64_t pf_lines, bool pf_l1) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  constexpr int kChains = MR * NP >= 4 ? 1 : 2;
  // pf: pf_lines cache lines of the next panels to prefetch, spread over this tile's pair-rows
  const int64_t pf_every = pf_lines > 0 ? std::max<int64_t>(1, k2 / kChains / pf_lines) : k2 + 1;
  int64_t pf_countdown = pf_every, pf_done = 0;
  __m512 acc[kChains][MR][NP];
  for (int c = 0; c < kChains; ++c)
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NP; ++j) acc[c][m][j] = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + kChains <= k2; t += kChains) {
    if (--pf_countdown == 0) {
      pf_countdown = pf_every;
      if (pf_done < pf_lines) {
        const char* line = reinterpret_cast<const char*>(pf) + 64 * pf_done++;
        if (pf_l1)
          _mm_prefetch(line, _MM_HINT_T0);
        else
          _mm_prefetch(line, _MM_HINT_T1);
      }
    }
    for (int c = 0; c < kChains; ++c) {
      __m512i wv[NP];
      for (int j = 0; j < NP; ++j) {
        wv[j] = _mm512_loadu_si512(b + j * pstride + (t + c) * 32);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512i xb = _mm512_set1_epi32(pair_at(x + m * ldx + 2 * (t + c)));
        for (int j = 0; j < NP; ++j) acc[c][m][j] = _mm512_dpbf16_ps(acc[c][m][j], as_bh(xb), as_bh(wv[j]));
      }
    }
  }
  for (; t < k2; ++t) {
    for (int j = 0; j < NP; ++j) {
      const __m512i wv = _mm512_loadu_si512(b + j * pstride + t * 32);
      for (int m = 0; m < MR; ++m)
        acc[0][m][j] = _mm512_dpbf16_ps(acc[0][m][j], as_bh(_mm512_set1_epi32(pair_at(x + m * ldx + 2 * t))),
                                        as_bh(wv));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NP; ++j) {
      __m512 s = acc[0][m][j];
      if constexpr (kChains == 2) s = _mm512_add_ps(s, acc[1][m][j]);
      const int64_t valid = std::min<int64_t>(16, nvalid - 16 * j);
      if (valid <= 0) continue;
      const __mmask16 mask = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
      if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, bias + 16 * j));
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(s);
      _mm256_mask_storeu_epi16(y + m * ldy + 16 * j, mask, h);
    }
#else
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NP; ++j)
      for (int c = 0; c < 16 && 16 * j + c < nvalid; ++c) {
        float s = 0.f;
        for (int64_t t = 0; t < k2; ++t)
          for (int i = 0; i < 2; ++i)
            s += bf16_to_float(x[m * ldx + 2 * t + i]) * bf16_to_float(b[j * pstride + t * 32 + 2 * c + i]);
        y[m * ldy + 16 * j + c] = float_to_bf16(s + (bias ? bias[16 * j + c] : 0.f));
      }
#endif
}

template <int NP>
void rows_against(const uint16_t* x, int64_t mrows, int64_t ldx, int64_t k2, const uint16_t* b, int64_t pstride,
                  const float* bias, uint16_t* y, int64_t ldy, int64_t nvalid, const uint16_t* next,
                  int64_t next_lines) {
  // the thread's next panels are read while these rows' tiles run, a share per tile
  const int64_t tiles = (mrows + kMR - 1) / kMR;
  const int64_t share = next ? (next_lines + tiles - 1) / tiles : 0;
  // up to 4 tiles (16 rows) the current panels are re-read from L1 by each tile: the next ones go to L2
  // then, so as not to evict them (measured: 1.25x at 8-16 rows into L2, 0.83-0.95x into L1); from 5
  // tiles on into L1 (1.15x at 32-64 rows, 1.05x into L2)
  const bool pf_l1 = tiles > 4;
  auto pf_of = [&](int64_t m) { return next ? next + 32 * std::min(next_lines, (m / kMR) * share) : nullptr; };
  auto lines_of = [&](int64_t m) {
    return next ? std::max<int64_t>(0, std::min(share, next_lines - (m / kMR) * share)) : int64_t(0);
  };
  int64_t m = 0;
  for (; m + kMR <= mrows; m += kMR)
    tile<kMR, NP>(x + m * ldx, ldx, k2, b, pstride, bias, y + m * ldy, ldy, nvalid, pf_of(m), lines_of(m), pf_l1);
  const int64_t rest = mrows - m;
  const uint16_t* xr = x + m * ldx;
  uint16_t* yr = y + m * ldy;
  switch (rest) {
#define HETEROLLM_CASE(R) \
  case R: tile<R, NP>(xr, ldx, k2, b, pstride, bias, yr, ldy, nvalid, pf_of(m), lines_of(m), pf_l1); break;
    HETEROLLM_CASE(1) HETEROLLM_CASE(2) HETEROLLM_CASE(3)
#undef HETEROLLM_CASE
    default: break;
  }
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16,
              "bf16_linear: x and panels must be bfloat16, got ", x.scalar_type(), " and ", panels.scalar_type());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 2 * kNR && panels.is_contiguous(),
              "bf16_linear: panels must be a contiguous (P, K / 2, 32) tensor (linear.py's pack_bf16_panels)");
  const int64_t p = panels.size(0), k2 = panels.size(1), k = x.size(-1);
  TORCH_CHECK(2 * k2 == k, "bf16_linear: x has ", k, " features, the panels ", 2 * k2);
  TORCH_CHECK(n > kNR * (p - 1) && n <= kNR * p, "bf16_linear: ", p, " panels hold ", kNR * (p - 1) + 1, "-",
              kNR * p, " output channels, not ", n);
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n, "bf16_linear: bias must be a vector of ", n);
  }
  at::Tensor bf;
  if (bias) bf = bias->to(at::kFloat).contiguous();
  const at::Tensor xc = x.reshape({-1, k}).contiguous();
  const int64_t m = xc.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y.view(shape);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* bp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  const float* biasp = bias ? bf.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t pstride = k2 * 32;
  const int64_t block = std::max<int64_t>(kMR, kBlockBytes / (2 * k) / kMR * kMR);
  const int64_t ptiles = (p + kNP - 1) / kNP;
  for (int64_t m0 = 0; m0 < m; m0 += block) {
    const int64_t mb = std::min(block, m - m0);
    // a thread's share at least 64 KB of panels: fewer forks for the small layers
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kNP * pstride * 2));
    at::parallel_for(0, ptiles, grain, [&](int64_t begin, int64_t end) {
      for (int64_t pt = begin; pt < end; ++pt) {
        const int64_t p0 = pt * kNP, np = std::min(kNP, p - p0);
        const int64_t nvalid = n - 16 * p0;
        const float* bt = biasp ? biasp + 16 * p0 : nullptr;
        // the next tile of panels, whole cache lines (a panel row is 64 bytes: 32 values)
        const uint16_t* next = pt + 1 < end ? bp + (p0 + kNP) * pstride : nullptr;
        const int64_t next_lines = next ? std::min(kNP, p - p0 - kNP) * k2 : 0;
        if (np == 2)
          rows_against<2>(xp + m0 * k, mb, k, k2, bp + p0 * pstride, pstride, bt, yp + m0 * n + 16 * p0, n, nvalid,
                          next, next_lines);
        else
          rows_against<1>(xp + m0 * k, mb, k, k2, bp + p0 * pstride, pstride, bt, yp + m0 * n + 16 * p0, n, nvalid,
                          next, next_lines);
      }
    });
  }
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
