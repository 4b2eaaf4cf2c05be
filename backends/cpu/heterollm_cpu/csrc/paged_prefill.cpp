// Paged prefill attention for the CPU backend, bf16: each prefill chunk's query rows attend
// causally to its sequence's keys (its cached context, then its own new tokens, already written to
// the paged cache), flash-style (an online softmax over tiles of 16 keys), with the AVX-512 bf16
// dot-product instruction (vdpbf16ps) for both products. Built by heterollm_cpu/kernels.py; where
// the CPU lacks AVX512_BF16 `paged_prefill_supported()` is false and attention.py keeps SDPA.
//
// query (T, H, D) bf16, any row / head strides, last dimension contiguous; kv_cache (2, KVH, NB,
// BS, D) bf16 contiguous; chunks: starts, ctx_lens, q_lens (C,) int64 (query rows starts[c] ..
// starts[c] + q_lens[c]; row t of chunk c attends to keys 0 .. ctx_lens[c] + t), block_tables
// (C, W) int64 covering each chunk's keys; out (T, H, D) bf16, written for the chunks' rows only.
// Scores, the softmax and the sums accumulate in fp32; the probabilities are rounded to bf16 for
// the product with V (as torch's CPU flash attention does for bf16).
#include <torch/extension.h>
#include "bf16_dot.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HETEROLLM_PREFILL 1
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc's libmvec
#endif

namespace {

#ifdef HETEROLLM_PREFILL

constexpr int kTile = 16;  // keys per tile, query rows per block

using heterollm_cpu::as_bh;

// -ffast-math may assume no infinities: "no key yet" and masked scores are this finite sentinel
constexpr float kNone = -1e30f;

// K of one (chunk, KV head), packed for the score product: per tile of 16 keys, for each pair of
// dims p, the 16 keys' (d = 2p, 2p + 1) values side by side: tile[p * 16 + j] = (k_j[2p], k_j[2p + 1]).
// V packed for the value product: per pair of keys (2i, 2i + 1), for each dim d: (v_2i[d], v_2i+1[d]).
// Keys past the sequence are zeros (their probabilities are exactly 0).
void pack_kv(const uint16_t* cache, int64_t kvh, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
             int64_t dim, const int64_t* table, int64_t keys, int64_t padded, uint32_t* kpack, uint32_t* vpack) {
  const int64_t half = dim / 2;
  const int64_t plane = num_kv_heads * num_blocks * block_size * dim;  // K, then V
  std::memset(kpack, 0, padded * half * sizeof(uint32_t));
  std::memset(vpack, 0, padded * half * sizeof(uint32_t));
  for (int64_t j = 0; j < keys; ++j) {
    const int64_t off = ((kvh * num_blocks + table[j / block_size]) * block_size + j % block_size) * dim;
    const uint32_t* k = reinterpret_cast<const uint32_t*>(cache + off);
    const uint16_t* v = cache + plane + off;
    uint32_t* kt = kpack + (j / kTile) * kTile * half + j % kTile;
    for (int64_t p = 0; p < half; ++p) kt[p * kTile] = k[p];
    uint16_t* vt = reinterpret_cast<uint16_t*>(vpack + (j / 2) * dim) + (j % 2);
    for (int64_t d = 0; d < dim; ++d) vt[2 * d] = v[d];
  }
}

// One block of up to 16 query rows of one (chunk, KV head): rows[r] is query row r's data (D bf16,
// zero rows for padding), limits[r] its number of keys; out_rows[r] where its output goes.
template <int D>
void attend_block(const uint16_t* const* rows, const int64_t* limits, int n, const uint32_t* kpack,
                  const uint32_t* vpack, float scale, uint16_t* const* out_rows) {
  constexpr int half = D / 2, chunks = D / 16;
  alignas(64) uint32_t q[kTile][half];
  for (int r = 0; r < kTile; ++r) {
    if (r < n) std::memcpy(q[r], rows[r], D * sizeof(uint16_t));
    else std::memset(q[r], 0, sizeof(q[r]));
  }
  int64_t max_limit = 0;
  for (int r = 0; r < n; ++r) max_limit = std::max(max_limit, limits[r]);
  const __m512 none = _mm512_set1_ps(kNone);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  float m[kTile], l[kTile];
  alignas(64) float acc[kTile][D];
  for (int r = 0; r < kTile; ++r) {
    m[r] = kNone;
    l[r] = 0.f;
    for (int d = 0; d < D; ++d) acc[r][d] = 0.f;
  }
  alignas(64) uint16_t probs[kTile][kTile];
  for (int64_t t = 0; t * kTile < max_limit; ++t) {
    const uint32_t* kt = kpack + t * kTile * half;
    __m512 s[kTile];
    for (int r = 0; r < kTile; ++r) s[r] = _mm512_setzero_ps();
    for (int p = 0; p < half; ++p) {
      const __m512bh k = as_bh(_mm512_loadu_si512(kt + p * kTile));
      for (int r = 0; r < kTile; ++r) s[r] = _mm512_dpbf16_ps(s[r], as_bh(_mm512_set1_epi32(static_cast<int>(q[r][p]))), k);
    }
    const __m512i key = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(t * kTile)));
    const uint32_t* vt = vpack + t * kTile * half;  // (16 / 2) key pairs x D dims
    for (int r = 0; r < n; ++r) {
      if (limits[r] <= t * kTile) continue;  // every key of the tile is in this row's future
      const __mmask16 valid = _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(limits[r])));
      const __m512 x = _mm512_mask_blend_ps(valid, none, _mm512_mul_ps(s[r], _mm512_set1_ps(scale)));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(x));
      const float alpha = std::exp(m[r] - m_new);  // 0 on the row's first tile
      const __m512 pr = _ZGVeN16v_expf(_mm512_sub_ps(x, _mm512_set1_ps(m_new)));
      const __m256bh pb = _mm512_cvtneps_pbh(pr);
      // the sum uses the rounded probabilities, the ones that multiply V
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)pb), 16)));
      m[r] = m_new;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs[r]), (__m256i)pb);
      const uint32_t* pp = reinterpret_cast<const uint32_t*>(probs[r]);
      __m512 o[chunks];
      const __m512 a = _mm512_set1_ps(alpha);
      for (int c = 0; c < chunks; ++c) o[c] = _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), a);
      for (int i = 0; i < kTile / 2; ++i) {
        const __m512bh pair = as_bh(_mm512_set1_epi32(static_cast<int>(pp[i])));
        for (int c = 0; c < chunks; ++c)
          o[c] = _mm512_dpbf16_ps(o[c], pair, as_bh(_mm512_loadu_si512(vt + i * D + 16 * c)));
      }
      for (int c = 0; c < chunks; ++c) _mm512_store_ps(acc[r] + 16 * c, o[c]);
    }
  }
  for (int r = 0; r < n; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int c = 0; c < chunks; ++c) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_rows[r] + 16 * c), (__m256i)y);
    }
  }
}

#endif  // HETEROLLM_PREFILL

bool supported() {
#ifdef HETEROLLM_PREFILL
  return true;
#else
  return false;
#endif
}

void paged_prefill(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor starts, torch::Tensor ctx_lens,
                   torch::Tensor q_lens, torch::Tensor block_tables, double scale, torch::Tensor out) {
  TORCH_CHECK(supported(), "paged_prefill: this build has no AVX512_BF16 (check paged_prefill_supported())");
  TORCH_CHECK(query.scalar_type() == torch::kBFloat16 && kv_cache.scalar_type() == torch::kBFloat16 &&
                  out.scalar_type() == torch::kBFloat16,
              "paged_prefill: query, kv_cache and out must be bfloat16");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "paged_prefill: query and out must be (T, H, D)");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "paged_prefill: head_dim must be contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_prefill: kv_cache must be a contiguous (2, KVH, NB, BS, D)");
  const int64_t heads = query.size(1), dim = query.size(2), kv_heads = kv_cache.size(1);
  const int64_t num_blocks = kv_cache.size(2), block_size = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == dim, "paged_prefill: head_dim differs between query and kv_cache");
  TORCH_CHECK(dim == 64 || dim == 128, "paged_prefill: head_dim must be 64 or 128, got ", dim);
  TORCH_CHECK(heads % kv_heads == 0, "paged_prefill: query heads must be a multiple of KV heads");
  const int64_t num_chunks = starts.numel();
  TORCH_CHECK(ctx_lens.numel() == num_chunks && q_lens.numel() == num_chunks && block_tables.dim() == 2 &&
                  block_tables.size(0) == num_chunks,
              "paged_prefill: starts, ctx_lens, q_lens and block_tables must describe the same chunks");
  for (auto* t : {&starts, &ctx_lens, &q_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == torch::kLong, "paged_prefill: chunk descriptions must be int64");
#ifdef HETEROLLM_PREFILL
  starts = starts.contiguous();
  ctx_lens = ctx_lens.contiguous();
  q_lens = q_lens.contiguous();
  block_tables = block_tables.contiguous();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1), group = heads / kv_heads, half = dim / 2;
  // packed K / V of every (chunk, KV head), keys padded to whole tiles
  std::vector<int64_t> key_off(num_chunks + 1, 0), row_blocks(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t keys = cl[c] + ql[c];
    TORCH_CHECK(ql[c] >= 0 && cl[c] >= 0 && st[c] >= 0 && st[c] + ql[c] <= query.size(0),
                "paged_prefill: chunk ", c, " lies outside the query");
    TORCH_CHECK((keys + block_size - 1) / block_size <= width, "paged_prefill: chunk ", c, "'s block table is short");
    for (int64_t b = 0; b < (keys + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[c * width + b] >= 0 && tables[c * width + b] < num_blocks, "paged_prefill: block id out of range");
    key_off[c + 1] = key_off[c] + (keys + kTile - 1) / kTile * kTile;
    row_blocks[c + 1] = row_blocks[c] + (ql[c] * group + kTile - 1) / kTile;
  }
  std::vector<uint32_t> kpack(kv_heads * key_off[num_chunks] * half), vpack(kv_heads * key_off[num_chunks] * half);
  const uint16_t* cache = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr());
  at::parallel_for(0, num_chunks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i / kv_heads, h = i % kv_heads;
      const int64_t padded = key_off[c + 1] - key_off[c], base = (h * key_off[num_chunks] + key_off[c]) * half;
      pack_kv(cache, h, kv_heads, num_blocks, block_size, dim, tables + c * width, cl[c] + ql[c], padded,
              kpack.data() + base, vpack.data() + base);
    }
  });
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(query.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  // tasks: (KV head, block of 16 query rows of one chunk); a chunk's rows are (token, group head) pairs
  const int64_t blocks_per_head = row_blocks[num_chunks];
  at::parallel_for(0, kv_heads * blocks_per_head, 1, [&](int64_t begin, int64_t end) {
    const uint16_t* rows[kTile];
    uint16_t* outs[kTile];
    int64_t limits[kTile];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks_per_head, b = task % blocks_per_head;
      const int64_t c = std::upper_bound(row_blocks.begin(), row_blocks.end(), b) - row_blocks.begin() - 1;
      const int64_t first = (b - row_blocks[c]) * kTile, total = ql[c] * group;
      const int n = static_cast<int>(std::min<int64_t>(kTile, total - first));
      for (int r = 0; r < n; ++r) {
        const int64_t t = (first + r) / group, head = h * group + (first + r) % group;
        rows[r] = qp + (st[c] + t) * qs0 + head * qs1;
        outs[r] = op + (st[c] + t) * os0 + head * os1;
        limits[r] = cl[c] + t + 1;
      }
      const int64_t base = (h * key_off[num_chunks] + key_off[c]) * half;
      if (dim == 64)
        attend_block<64>(rows, limits, n, kpack.data() + base, vpack.data() + base, static_cast<float>(scale), outs);
      else
        attend_block<128>(rows, limits, n, kpack.data() + base, vpack.data() + base, static_cast<float>(scale), outs);
    }
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("paged_prefill_supported() -> bool", &supported);
  m.def("paged_prefill(Tensor query, Tensor kv_cache, Tensor starts, Tensor ctx_lens, Tensor q_lens, "
        "Tensor block_tables, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
