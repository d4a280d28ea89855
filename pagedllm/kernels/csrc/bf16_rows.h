// Row conversions between bfloat16 and float32 written with integer ops, so that loops over them vectorise
// (c10's scalar conversions do not). bfloat16 is the top half of a float32; rounding is to nearest even.
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

inline void load_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }

inline void load_row(float* dst, const at::BFloat16* src, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    dst[i] = f;
  }
}

// dst[i] = src[i] * mul
inline void store_row(float* dst, const float* src, float mul, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * mul;
}

inline void store_row(at::BFloat16* dst, const float* src, float mul, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    const float f = src[i] * mul;
    std::memcpy(&bits, &f, 4);
    d[i] = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
}
