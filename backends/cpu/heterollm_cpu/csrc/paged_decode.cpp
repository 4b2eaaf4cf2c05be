// Paged decode attention for the CPU backend: one query row per sequence (or per speculative draft
// row of a causal verification), reading each key and value of its blocks once, straight from the
// paged cache. Built from source by scripts/setup.sh (heterollm_cpu/kernels.py); the torch path in
// attention.py is the fallback and the reference.
//
// query (R, H, D); kv_cache (2, KVH, NB, BS, D); block_tables (R * W,) int64, each row's W blocks
// in order (flat, so a compiled caller never sees a dimension that may be 1); seq_lens (R,) int64,
// the keys each row attends to (positions 0 .. len-1); -> (R, H, D).
// Scores, softmax and the weighted sum accumulate in fp32 whatever the storage dtype (fp32 or bf16).
// A bf16 query over a bf16 cache at head dim 64 or 128, on a CPU with AVX512_BF16, takes the
// dot-product path (decode_rows_bf16): the probabilities are rounded to bf16 before they weight V,
// as in the prefill kernel; every other combination widens to fp32 and uses FMA.
// Both paths prefetch (Ahead): a block is a few KB at a random place in the cache, and the hardware
// prefetchers, which stop at each 4 KB page, reached about half the read bandwidth on such reads.
#include <torch/extension.h>
#include "bf16_dot.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <type_traits>
#include <limits>
#include <vector>

namespace {

// Software prefetch along the order a thread reads the cache: item after item ((row, KV head)), each
// item's key blocks then its value blocks, kAheadLines cache lines ahead of the reads (into L2: a
// prefetch into L1 measured slower). The caller queues items (add) and, as it reads n lines,
// prefetches the next n (issue).
constexpr int64_t kAheadLines = 96;

struct Ahead {
  std::vector<const char*> ptr;
  std::vector<int64_t> lines;
  size_t cur = 0;
  int64_t off = 0, queued = 0;  // lines queued and not yet prefetched
  void add(const void* p, int64_t bytes) {
    if (cur > 256 && cur * 2 > ptr.size()) {  // drop the segments already prefetched
      ptr.erase(ptr.begin(), ptr.begin() + static_cast<std::ptrdiff_t>(cur));
      lines.erase(lines.begin(), lines.begin() + static_cast<std::ptrdiff_t>(cur));
      cur = 0;
    }
    const int64_t n = (bytes + 63) / 64;
    ptr.push_back(static_cast<const char*>(p));
    lines.push_back(n);
    queued += n;
  }
  inline void issue(int64_t n) {
    n = std::min(n, queued);
    queued -= n;
    while (n > 0) {
      const int64_t take = std::min(n, lines[cur] - off);
      const char* base = ptr[cur] + off * 64;
      for (int64_t i = 0; i < take; ++i) __builtin_prefetch(base + i * 64, 0, 2);
      n -= take;
      off += take;
      if (off == lines[cur]) {
        ++cur;
        off = 0;
      }
    }
  }
  // queue items until kAheadLines + `need` lines wait (the next read's lines and the distance): item i
  // is row i / kv_heads's key blocks, then its value blocks, of KV head i % kv_heads
  template <typename KV>
  inline void fill(int64_t& next, int64_t end, int64_t need, const KV* keys, const KV* values, int64_t kv_heads,
                   int64_t head_stride, const int64_t* tables, int64_t width, const int64_t* lens,
                   int64_t block_size, int64_t dim) {
    for (; next < end && queued < kAheadLines + need; ++next) {
      const int64_t r = next / kv_heads, h = next % kv_heads;
      for (const KV* base : {keys, values})
        for (int64_t start = 0; start < lens[r]; start += block_size)
          add(base + h * head_stride + tables[r * width + start / block_size] * block_size * dim,
              std::min(block_size, lens[r] - start) * dim * static_cast<int64_t>(sizeof(KV)));
    }
  }
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// The two inner loops over one block's keys (n rows of `dim`, contiguous in the cache):
// scores[g * stride + j] = q_g . k_j, and acc_g += p[g * stride + j] * v_j, for the `group` query
// heads sharing the KV head. Generic versions first; AVX-512 ones for head dims 64 and 128 keep a
// key in registers (bf16: widened once) across the group's heads.
template <typename KV>
inline void block_scores_any(const float* q, const KV* keys, int64_t n, int64_t group, int64_t dim, float* scores,
                             int64_t stride) {
  for (int64_t j = 0; j < n; ++j) {
    const KV* k = keys + j * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * to_float(k[d]);
      scores[g * stride + j] = s;
    }
  }
}

template <typename KV>
inline void block_values_any(const float* probs, int64_t stride, const KV* values, int64_t n, int64_t group,
                             int64_t dim, float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    const KV* v = values + j * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = probs[g * stride + j];
      float* ag = acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] += p * to_float(v[d]);
    }
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the high half of an fp32: widen, shift
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <int DC, typename KV>
inline void block_scores_512(const float* q, const KV* keys, int64_t n, int64_t group, float* scores,
                             int64_t stride) {
  for (int64_t j = 0; j < n; ++j) {
    __m512 k[DC];
    const KV* kj = keys + j * DC * 16;
    for (int c = 0; c < DC; ++c) k[c] = load16(kj + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * DC * 16;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
      for (int c = 1; c < DC; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), k[c], acc);
      scores[g * stride + j] = _mm512_reduce_add_ps(acc);
    }
  }
}

template <int DC, typename KV>
inline void block_values_512(const float* probs, int64_t stride, const KV* values, int64_t n, int64_t group,
                             float* acc) {
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[DC];
    const KV* vj = values + j * DC * 16;
    for (int c = 0; c < DC; ++c) v[c] = load16(vj + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * stride + j]);
      float* ag = acc + g * DC * 16;
      for (int c = 0; c < DC; ++c) {
        _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(p, v[c], _mm512_loadu_ps(ag + 16 * c)));
      }
    }
  }
}
#endif

template <typename KV>
inline void block_scores(const float* q, const KV* keys, int64_t n, int64_t group, int64_t dim, float* scores,
                         int64_t stride) {
#if defined(__AVX512F__)
  if (dim == 64) return block_scores_512<4>(q, keys, n, group, scores, stride);
  if (dim == 128) return block_scores_512<8>(q, keys, n, group, scores, stride);
#endif
  block_scores_any(q, keys, n, group, dim, scores, stride);
}

template <typename KV>
inline void block_values(const float* probs, int64_t stride, const KV* values, int64_t n, int64_t group, int64_t dim,
                         float* acc) {
#if defined(__AVX512F__)
  if (dim == 64) return block_values_512<4>(probs, stride, values, n, group, acc);
  if (dim == 128) return block_values_512<8>(probs, stride, values, n, group, acc);
#endif
  block_values_any(probs, stride, values, n, group, dim, acc);
}

template <typename Q, typename KV>
void decode_rows(const Q* query, const KV* cache, const int64_t* tables, const int64_t* lens, Q* out,
                 int64_t rows, int64_t heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size,
                 int64_t dim, int64_t width, int64_t max_len, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t head_stride = num_blocks * block_size * dim;  // one KV head of K (or of V)
  const KV* keys = cache;
  const KV* values = cache + kv_heads * head_stride;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(KV));
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * dim), scores(group * max_len), acc(group * dim), total(group);
    Ahead ahead;
    int64_t queued_items = begin;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[r];
      const int64_t* table = tables + r * width;
      ahead.fill(queued_items, end, 2 * (len * row_bytes + 63) / 64, keys, values, kv_heads, head_stride, tables, width,
                 lens, block_size, dim);
      if (item == begin) ahead.issue(kAheadLines);
      for (int64_t g = 0; g < group; ++g) {
        const Q* src = query + (r * heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) q[g * dim + d] = to_float(src[d]) * scale;
      }
      // scores: each key once, for every query head of the group (16 keys per prefetch)
      for (int64_t start = 0; start < len; start += block_size) {
        const KV* block = keys + h * head_stride + table[start / block_size] * block_size * dim;
        const int64_t n = std::min(block_size, len - start);
        for (int64_t j = 0; j < n; j += 16) {
          const int64_t m = std::min<int64_t>(16, n - j);
          ahead.issue((m * row_bytes + 63) / 64);
          block_scores(q.data(), block + j * dim, m, group, dim, scores.data() + start + j, max_len);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * max_len;
        float peak = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : peak)
        for (int64_t t = 0; t < len; ++t) peak = std::max(peak, sg[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - peak);  // vectorized (libmvec) under -ffast-math
          sum += sg[t];
        }
        total[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      // the weighted sum: each value once
      for (int64_t start = 0; start < len; start += block_size) {
        const KV* block = values + h * head_stride + table[start / block_size] * block_size * dim;
        const int64_t n = std::min(block_size, len - start);
        for (int64_t j = 0; j < n; j += 16) {
          const int64_t m = std::min<int64_t>(16, n - j);
          ahead.issue((m * row_bytes + 63) / 64);
          block_values(scores.data() + start + j, max_len, block + j * dim, m, group, dim, acc.data());
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        Q* dst = out + (r * heads + h * group + g) * dim;
        const float inv = 1.f / total[g];
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<Q>(acc[g * dim + d] * inv);
      }
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bf16 query and cache, head dim 64 or 128: both products on the bf16 dot-product instruction
// (vdpbf16ps: 32 bf16 products summed pairwise into 16 fp32 lanes), as the prefill kernel does.
// Scores: per query head, 16 keys' lane-wise partial sums, then one transposed reduction of the 16
// vectors into the 16 scores (where the generic loop reduces each key's vector alone). Values: the
// probabilities rounded to bf16, two keys at a time (their value rows interleaved word by word, so
// each fp32 lane sums p_j v_j[d] + p_j+1 v_j+1[d]), the accumulators in registers for up to 16
// vectors of (query head, 16 dims).

using heterollm_cpu::as_bh;

// r[j] = sum of the 16 lanes of v[j]
inline __m512 transpose_sum16(__m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores[g * stride + j] = scale * q_g . k_j for the n keys of one block (D = 32 * C dims)
template <int C>
inline void block_scores_bf16(const __m512bh* q, const uint16_t* keys, int64_t n, int64_t group, float scale,
                              float* scores, int64_t stride, Ahead& ahead) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t j0 = 0;
  for (; j0 + 16 <= n; j0 += 16) {
    ahead.issue(16 * C);  // a key is C cache lines
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        const uint16_t* k = keys + (j0 + j) * 32 * C;
        acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g * C], as_bh(_mm512_loadu_si512(k)));
        for (int c = 1; c < C; ++c) acc[j] = _mm512_dpbf16_ps(acc[j], q[g * C + c], as_bh(_mm512_loadu_si512(k + 32 * c)));
      }
      _mm512_storeu_ps(scores + g * stride + j0, _mm512_mul_ps(transpose_sum16(acc), sc));
    }
  }
  ahead.issue((n - j0) * C);
  for (int64_t j = j0; j < n; ++j) {  // the block's last keys, one at a time
    const uint16_t* k = keys + j * 32 * C;
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g * C], as_bh(_mm512_loadu_si512(k)));
      for (int c = 1; c < C; ++c) acc = _mm512_dpbf16_ps(acc, q[g * C + c], as_bh(_mm512_loadu_si512(k + 32 * c)));
      scores[g * stride + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// acc[g][2c] / acc[g][2c + 1] += the value rows of the block's n keys weighted by probs (bf16 pairs
// per key pair, probs[g * pstride + j / 2]) for heads g0 .. g0 + GB; C: 32-dim chunks per row.
// Lane e of 128-bit lane L of acc[g][2c] holds dim 32c + 8L + e, of acc[g][2c + 1] dim 32c + 8L + 4 + e.
template <int C, int GB>
inline void block_values_bf16(const uint32_t* probs, int64_t pstride, const uint16_t* values, int64_t n, int gb,
                              __m512 (*acc)[2 * C], Ahead* ahead) {
  for (int64_t j = 0; j < n; j += 2) {
    if (ahead) ahead->issue(2 * C);
    __m512i pairs[2 * C];
    for (int c = 0; c < C; ++c) {
      const __m512i a = _mm512_loadu_si512(values + j * 32 * C + 32 * c);
      const __m512i b = j + 1 < n ? _mm512_loadu_si512(values + (j + 1) * 32 * C + 32 * c) : _mm512_setzero_si512();
      pairs[2 * c] = _mm512_unpacklo_epi16(a, b);
      pairs[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
    for (int g = 0; g < GB; ++g) {
      if (g >= gb) break;
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(probs[g * pstride + j / 2])));
      for (int c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], p, as_bh(pairs[c]));
    }
  }
}

template <int C>
void decode_rows_bf16(const uint16_t* query, const uint16_t* cache, const int64_t* tables, const int64_t* lens,
                      uint16_t* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t num_blocks,
                      int64_t block_size, int64_t width, int64_t max_len, float scale) {
  constexpr int64_t dim = 32 * C;
  constexpr int GB = 8 / C;  // heads per pass of the weighted sum: 2C vectors each, 16 accumulators
  const int64_t group = heads / kv_heads;
  const int64_t head_stride = num_blocks * block_size * dim;
  const uint16_t* keys = cache;
  const uint16_t* values = cache + kv_heads * head_stride;
  const int64_t pstride = max_len + 1;  // pairs of bf16 probabilities: each block's own, an odd one padded
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> q(group * C);
    std::vector<float> scores(group * max_len), total(group);
    std::vector<uint32_t> probs(group * pstride);
    alignas(64) float lanes[2][16];
    Ahead ahead;
    int64_t queued_items = begin;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[r];
      const int64_t* table = tables + r * width;
      ahead.fill(queued_items, end, 2 * C * len, keys, values, kv_heads, head_stride, tables, width, lens, block_size,
                 dim);
      if (item == begin) ahead.issue(kAheadLines);
      for (int64_t g = 0; g < group; ++g)
        for (int c = 0; c < C; ++c)
          q[g * C + c] = as_bh(_mm512_loadu_si512(query + (r * heads + h * group + g) * dim + 32 * c));
      for (int64_t start = 0; start < len; start += block_size) {
        const uint16_t* block = keys + h * head_stride + table[start / block_size] * block_size * dim;
        block_scores_bf16<C>(q.data(), block, std::min(block_size, len - start), group, scale,
                             scores.data() + start, max_len, ahead);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * max_len;
        float peak = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : peak)
        for (int64_t t = 0; t < len; ++t) peak = std::max(peak, sg[t]);
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sg[t] = std::exp(sg[t] - peak);
        // the probabilities as bf16 pairs, block by block (a block's odd last key pairs with a zero);
        // the sum is taken over the rounded values, the ones that weight V
        uint16_t* pg = reinterpret_cast<uint16_t*>(probs.data() + g * pstride);
        float sum = 0.f;
        int64_t at = 0;
        for (int64_t start = 0; start < len; start += block_size) {
          const int64_t n = std::min(block_size, len - start);
          for (int64_t t = 0; t < n; ++t) {
            const c10::BFloat16 b(sg[start + t]);
            pg[at + t] = b.x;
            sum += static_cast<float>(b);
          }
          if (n % 2) pg[at + n] = 0;
          at += n + n % 2;
        }
        total[g] = sum;
      }
      for (int64_t g0 = 0; g0 < group; g0 += GB) {
        const int gb = static_cast<int>(std::min<int64_t>(GB, group - g0));
        __m512 acc[GB][2 * C];
        for (int g = 0; g < GB; ++g)
          for (int c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_setzero_ps();
        int64_t at = 0;
        for (int64_t start = 0; start < len; start += block_size) {
          const int64_t n = std::min(block_size, len - start);
          const uint16_t* block = values + h * head_stride + table[start / block_size] * block_size * dim;
          block_values_bf16<C, GB>(probs.data() + g0 * pstride + at / 2, pstride, block, n, gb, acc,
                                   g0 == 0 ? &ahead : nullptr);  // the first pass over V prefetches
          at += n + n % 2;
        }
        for (int g = 0; g < gb; ++g) {
          uint16_t* dst = out + (r * heads + h * group + g0 + g) * dim;
          const float inv = 1.f / total[g0 + g];
          for (int c = 0; c < C; ++c) {
            _mm512_store_ps(lanes[0], acc[g][2 * c]);
            _mm512_store_ps(lanes[1], acc[g][2 * c + 1]);
            for (int half = 0; half < 2; ++half)
              for (int lane = 0; lane < 16; ++lane)
                dst[32 * c + 8 * (lane / 4) + 4 * half + lane % 4] = c10::BFloat16(lanes[half][lane] * inv).x;
          }
        }
      }
    }
  });
}
#endif

template <typename Q>
void dispatch_kv(const torch::Tensor& query, const torch::Tensor& cache, const torch::Tensor& tables,
                 const torch::Tensor& lens, torch::Tensor& out, int64_t max_len, float scale) {
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = cache.size(1), num_blocks = cache.size(2), block_size = cache.size(3);
  const int64_t width = tables.size(0) / rows;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (std::is_same<Q, c10::BFloat16>::value && cache.scalar_type() == torch::kBFloat16 && (dim == 64 || dim == 128)) {
    auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
    auto* kv = reinterpret_cast<const uint16_t*>(cache.data_ptr());
    auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
    if (dim == 64)
      decode_rows_bf16<2>(q, kv, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), o, rows, heads, kv_heads,
                          num_blocks, block_size, width, max_len, scale);
    else
      decode_rows_bf16<4>(q, kv, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), o, rows, heads, kv_heads,
                          num_blocks, block_size, width, max_len, scale);
    return;
  }
#endif
  if (cache.scalar_type() == torch::kBFloat16) {
    decode_rows<Q, c10::BFloat16>(query.data_ptr<Q>(), cache.data_ptr<c10::BFloat16>(), tables.data_ptr<int64_t>(),
                                  lens.data_ptr<int64_t>(), out.data_ptr<Q>(), rows, heads, kv_heads, num_blocks,
                                  block_size, dim, width, max_len, scale);
  } else {
    decode_rows<Q, float>(query.data_ptr<Q>(), cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
                          lens.data_ptr<int64_t>(), out.data_ptr<Q>(), rows, heads, kv_heads, num_blocks, block_size,
                          dim, width, max_len, scale);
  }
}

torch::Tensor paged_decode(const torch::Tensor& query_in, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_tables_in, const torch::Tensor& seq_lens_in, double scale) {
  TORCH_CHECK(query_in.dim() == 3, "paged_decode: query must be (rows, heads, dim)");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "paged_decode: kv_cache must be (2, KVH, NB, BS, D)");
  TORCH_CHECK(kv_cache.is_contiguous(), "paged_decode: kv_cache must be contiguous");
  TORCH_CHECK(query_in.size(2) == kv_cache.size(4), "paged_decode: head dims differ");
  TORCH_CHECK(query_in.size(1) % kv_cache.size(1) == 0, "paged_decode: heads must be a multiple of KV heads");
  const auto qt = query_in.scalar_type(), kt = kv_cache.scalar_type();
  TORCH_CHECK(qt == torch::kFloat || qt == torch::kBFloat16, "paged_decode: query must be float32 or bfloat16");
  TORCH_CHECK(kt == torch::kFloat || kt == torch::kBFloat16, "paged_decode: kv_cache must be float32 or bfloat16");
  const auto query = query_in.contiguous();
  const auto tables = block_tables_in.to(torch::kLong).contiguous();
  const auto lens = seq_lens_in.to(torch::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 1 && query.size(0) > 0 && tables.size(0) % query.size(0) == 0,
              "paged_decode: block_tables must hold the same number of blocks for every row");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == query.size(0), "paged_decode: one length per row");
  auto out = torch::empty_like(query);
  const int64_t max_len = lens.max().item<int64_t>();
  TORCH_CHECK(lens.min().item<int64_t>() >= 1, "paged_decode: every row attends to at least one key");
  TORCH_CHECK(max_len <= tables.size(0) / query.size(0) * kv_cache.size(3),
              "paged_decode: a row is longer than its block table");
  if (qt == torch::kBFloat16) {
    dispatch_kv<c10::BFloat16>(query, kv_cache, tables, lens, out, max_len, static_cast<float>(scale));
  } else {
    dispatch_kv<float>(query, kv_cache, tables, lens, out, max_len, static_cast<float>(scale));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heterollm_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(heterollm_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
