// fp8 K/V (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): one byte per element, read as float32 in registers by the same
// loads the float32 and bf16 caches have (load8 / load16 / to_float), and rounded from float32 when stored.
//
// Both formats widen through IEEE half (F16C's vcvtph2ps, exact for every half, subnormals included): an e5m2
// byte is the top byte of the half of the same value. An e4m3 byte's 4 exponent bits (bias 7) are placed in half's
// 5 (bias 15) unchanged, which reads the value times 2^-8 (subnormals included); KvUnit<Fp8E4M3> = 2^8 is folded
// into the per-layer scales by the kernels, so no load pays a multiply.
#pragma once
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

// What a load of KV must be multiplied by to give the stored value (times the layer's scale).
template <typename KV>
constexpr float kv_unit() {
  return std::is_same_v<KV, Fp8E4M3> ? 256.f : 1.f;
}

// The half bits a byte widens through (see above).
inline uint16_t fp8_half_bits(Fp8E4M3 v) {
  return static_cast<uint16_t>(((v.bits & 0x80u) << 8) | ((v.bits & 0x7Fu) << 7));
}
inline uint16_t fp8_half_bits(Fp8E5M2 v) { return static_cast<uint16_t>(v.bits << 8); }

inline float to_float(Fp8E4M3 v) { return static_cast<float>(c10::Half(fp8_half_bits(v), c10::Half::from_bits())); }
inline float to_float(Fp8E5M2 v) { return static_cast<float>(c10::Half(fp8_half_bits(v), c10::Half::from_bits())); }

#if defined(__AVX2__) && defined(__F16C__)
inline __m128i fp8_halves8(const Fp8E4M3* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                      _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
}
inline __m128i fp8_halves8(const Fp8E5M2* p) {
  return _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
}
inline __m256 load8(const Fp8E4M3* p) { return _mm256_cvtph_ps(fp8_halves8(p)); }
inline __m256 load8(const Fp8E5M2* p) { return _mm256_cvtph_ps(fp8_halves8(p)); }
#elif defined(__AVX2__)
template <typename F8>
inline __m256 load8_fp8_scalar(const F8* p) {
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = to_float(p[i]);
  return _mm256_load_ps(f);
}
inline __m256 load8(const Fp8E4M3* p) { return load8_fp8_scalar(p); }
inline __m256 load8(const Fp8E5M2* p) { return load8_fp8_scalar(p); }
#endif

#if defined(__AVX512F__)
inline __m512 load16(const Fp8E4M3* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_cvtph_ps(h);
}
inline __m512 load16(const Fp8E5M2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                           8));
}
#endif

// dst[i] = fp8(src[i] * mul), saturated to the format's largest finite value (a value past the range
// is stored as the range's end, never as NaN or inf), rounded to nearest even.
template <typename Src>
inline void store_row_fp8(Fp8E4M3* dst, const Src* src, float mul, int64_t n) {
  constexpr float kMax = 448.f;
  for (int64_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(src[i]) * mul;
    dst[i].bits = c10::Float8_e4m3fn(std::clamp(f, -kMax, kMax)).x;
  }
}
template <typename Src>
inline void store_row_fp8(Fp8E5M2* dst, const Src* src, float mul, int64_t n) {
  constexpr float kMax = 57344.f;
  for (int64_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(src[i]) * mul;
    dst[i].bits = c10::Float8_e5m2(std::clamp(f, -kMax, kMax)).x;
  }
}
