// The largest of n floats, in vectors. GCC leaves `#pragma omp simd reduction(max : m)` loops scalar (vmaxss), and
// that scalar pass was a fifth of a bf16 decode layer's attention and the first pass of every sampled row. Like the
// rest of paged_attention.cpp and sampling.cpp, the vector width is the build's (-march).
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::max();
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 v = _mm512_set1_ps(m);
  for (; t + 16 <= n; t += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + t));
  m = _mm512_reduce_max_ps(v);
#elif defined(__AVX2__)
  __m256 v = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (float l : lanes) m = std::max(m, l);
#endif
  for (; t < n; ++t) m = std::max(m, x[t]);
  return m;
}
