// Row conversions between bfloat16 and float32 written with integer ops, so that loops over them vectorise
// (c10's scalar conversions do not), and the vector loads of 8 / 16 elements as float32 that hand-written
// kernels share. bfloat16 is the top half of a float32; rounding is to nearest even.
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // widened: each bf16 shifted into the top half of a float32
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

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
