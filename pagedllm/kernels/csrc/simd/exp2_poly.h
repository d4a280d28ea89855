// 2^t in 16 float lanes by a polynomial: the softmax of the encoder attention, the SiLU of a decoder's MLP and the
// sampler's softmax weights.
#pragma once
#include <immintrin.h>

constexpr float LOG2E = 1.4426950408889634f;  // e^x = 2^(x * LOG2E)

// 2^t: f = t - floor(t) in [0, 1) (vreduceps), 2^f by a polynomial of degree 4 fitted for relative error (< 3e-6),
// times 2^floor(t) (vscalefps floors its exponent itself; lanes far below the float range come out 0, lanes far
// above it infinity, not garbage). Six instructions for 16 lanes.
__attribute__((target("avx512f,avx512dq"))) inline __m512 exp2_poly(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.35340253e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.20113967e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.41443068e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93003714e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.00000262f));
  return _mm512_scalef_ps(p, t);
}
