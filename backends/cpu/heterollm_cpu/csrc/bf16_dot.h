// Shared by the CPU kernels that use the AVX512_BF16 dot-product instruction (paged_decode.cpp,
// paged_prefill.cpp). kernels.py hashes this header with the sources, so an edit rebuilds both.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace heterollm_cpu {
// 32 bf16 values in a 512-bit integer register, as the operand vdpbf16ps takes
inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }
}  // namespace heterollm_cpu
#endif
