// Scalar bf16 <-> fp32 and the two storage types the elementwise kernels template on (fused_ops.cpp,
// int8_linear.cpp). kernels.py hashes this header with the sources, so an edit rebuilds them.
#pragma once
#include <cstdint>
#include <cstring>

namespace heterollm_cpu {

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept a NaN (as c10::BFloat16)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // a bit test: -ffast-math drops isnan
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// Element access for the two storage types: load widens to fp32, store rounds, round() rounds an fp32
// value to the storage precision and back (what a torch op on that dtype does to its result).
struct F32 {
  using T = float;
  static inline float load(const T* p, int64_t i) { return p[i]; }
  static inline void store(T* p, int64_t i, float v) { p[i] = v; }
  static inline float round(float v) { return v; }
};
struct BF16 {
  using T = uint16_t;
  static inline float load(const T* p, int64_t i) { return bf16_to_float(p[i]); }
  static inline void store(T* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
  static inline float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

}  // namespace heterollm_cpu
