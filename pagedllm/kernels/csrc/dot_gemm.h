// What the byte-dot-product matmuls share (q4_dot_gemm.cpp: 4-bit weights, q8_dot_gemm.cpp: 8-bit weights):
// float32 activations split into two int8 terms per (row, weight group), and the loop over panels and row tiles.
//
// x is split per (row, group) as x ~= dx * x1 + (dx / 254) * x2, with dx = max|x| / 127: x1 as llama.cpp's Q8
// blocks, x2 the rounding residual of x1 (|x - dx * x1| <= dx / 2, so x2 fits in int8 too). One int8 term alone
// moved the default model's perplexity by 2%; two leave x with ~16-bit precision, and the second costs one more
// dot product per 4 weights, not another unpacking of the weights.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dot_gemm {

constexpr int64_t NR = 16;               // output columns per panel
constexpr int MR = 4;                    // rows per tile
constexpr float RESIDUAL_STEPS = 254.f;  // x2's step is dx / 254: |residual| <= dx / 2 -> |x2| <= 127

// x split per (row, group): x1, x2 int8 [M, K]; dx = max|x| / 127 and xs = sum(x), float [M, G]; the integer
// sums of x1 and x2 over each group, int32 [M, G] (what a weight offset of +128 adds to a u8 x s8 dot product).
struct Activations {
  std::vector<int8_t> x1, x2;
  std::vector<float> d, s;
  std::vector<int32_t> s1, s2;
};

// One group of one row: x1, x2, and (dx, sum x, sum x1, sum x2). Every path rounds as the portable one does
// (nearbyint: to nearest, ties to even) and gives the same x1 and x2; the float sum may differ in its last bits.
// The residual is taken from the unrounded x * inv by a fused multiply-add in every path, so no compiler's
// choice to contract (or not) x * inv - x1 changes x2.
inline float residual(float x, float inv, float l1) { return std::fma(x, inv, -l1) * RESIDUAL_STEPS; }
struct GroupStats {
  float d, sum;
  int32_t s1, s2;
};

// max|x| and sum x over r[from, to), added to amax and sum (the scalar part of every path).
inline void scan_range(const float* r, int64_t from, int64_t to, float& amax, float& sum) {
  for (int64_t k = from; k < to; ++k) {
    amax = std::max(amax, std::fabs(r[k]));
    sum += r[k];
  }
}

inline float inverse_step(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }  // 1 / dx

// x1, x2 of r[from, to), their sums added to s1 and s2 (the scalar part of every path).
inline void split_range(const float* r, int64_t from, int64_t to, float inv, int8_t* q1, int8_t* q2, int32_t& s1,
                        int32_t& s2) {
  for (int64_t k = from; k < to; ++k) {
    const float l1 = std::nearbyint(r[k] * inv);  // in units of dx
    q1[k] = static_cast<int8_t>(l1);
    q2[k] = static_cast<int8_t>(std::clamp(std::nearbyint(residual(r[k], inv, l1)), -127.f, 127.f));
    s1 += q1[k];
    s2 += q2[k];
  }
}

inline GroupStats split_group_generic(const float* r, int64_t group, int8_t* q1, int8_t* q2) {
  float amax = 0.f, sum = 0.f;
  scan_range(r, 0, group, amax, sum);
  const float inv = inverse_step(amax);
  int32_t s1 = 0, s2 = 0;
  split_range(r, 0, group, inv, q1, q2, s1, s2);
  return {amax / 127.f, sum, s1, s2};
}

#if defined(__x86_64__)
// 16 k at a time: the scalar loop took ~3 us of a 1536-wide decode row on an Intel Xeon, a third of the matmul's time.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline GroupStats split_group_avx512(
    const float* r, int64_t group, int8_t* q1, int8_t* q2) {
  const int64_t vec = group / 16 * 16;
  __m512 vmax = _mm512_setzero_ps(), vsum = _mm512_setzero_ps();
  for (int64_t k = 0; k < vec; k += 16) {
    const __m512 v = _mm512_loadu_ps(r + k);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    vsum = _mm512_add_ps(vsum, v);
  }
  float amax = _mm512_reduce_max_ps(vmax), sum = _mm512_reduce_add_ps(vsum);
  scan_range(r, vec, group, amax, sum);
  const float inv = inverse_step(amax);
  const __m512 vinv = _mm512_set1_ps(inv), steps = _mm512_set1_ps(RESIDUAL_STEPS);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  __m512i c1 = _mm512_setzero_si512(), c2 = _mm512_setzero_si512();
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t k = 0; k < vec; k += 16) {
    const __m512 x = _mm512_loadu_ps(r + k);
    const __m512 l1 = _mm512_roundscale_ps(_mm512_mul_ps(x, vinv), kNearest);
    const __m512 res = _mm512_mul_ps(_mm512_fmsub_ps(x, vinv, l1), steps);
    const __m512 l2 = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(res, kNearest)));
    const __m512i i1 = _mm512_cvtps_epi32(l1), i2 = _mm512_cvtps_epi32(l2);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + k), _mm512_cvtepi32_epi8(i1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + k), _mm512_cvtepi32_epi8(i2));
    c1 = _mm512_add_epi32(c1, i1);
    c2 = _mm512_add_epi32(c2, i2);
  }
  int32_t s1 = _mm512_reduce_add_epi32(c1), s2 = _mm512_reduce_add_epi32(c2);
  split_range(r, vec, group, inv, q1, q2, s1, s2);
  return {amax / 127.f, sum, s1, s2};
}

// The same 8 k at a time, for the AVX2 tiles.
__attribute__((target("avx2,fma"))) inline GroupStats split_group_avx2(const float* r, int64_t group, int8_t* q1,
                                                                       int8_t* q2) {
  const int64_t vec = group / 8 * 8;
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
  for (int64_t k = 0; k < vec; k += 8) {
    const __m256 v = _mm256_loadu_ps(r + k);
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
    vsum = _mm256_add_ps(vsum, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.f;
  for (float v : lanes) amax = std::max(amax, v);
  _mm256_store_ps(lanes, vsum);
  float sum = 0.f;
  for (float v : lanes) sum += v;
  scan_range(r, vec, group, amax, sum);
  const float inv = inverse_step(amax);
  const __m256 vinv = _mm256_set1_ps(inv), steps = _mm256_set1_ps(RESIDUAL_STEPS);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i c1 = _mm256_setzero_si256(), c2 = _mm256_setzero_si256();
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t k = 0; k < vec; k += 8) {
    const __m256 x = _mm256_loadu_ps(r + k);
    const __m256 l1 = _mm256_round_ps(_mm256_mul_ps(x, vinv), kNearest);
    const __m256 res = _mm256_mul_ps(_mm256_fmsub_ps(x, vinv, l1), steps);
    const __m256 l2 = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(res, kNearest)));
    const __m256i i1 = _mm256_cvtps_epi32(l1), i2 = _mm256_cvtps_epi32(l2);
    // 8 int32 in -127..127 -> 8 int8 (the packs never saturate).
    const __m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(i1), _mm256_extracti128_si256(i1, 1));
    const __m128i w2 = _mm_packs_epi32(_mm256_castsi256_si128(i2), _mm256_extracti128_si256(i2, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q1 + k), _mm_packs_epi16(w1, w1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q2 + k), _mm_packs_epi16(w2, w2));
    c1 = _mm256_add_epi32(c1, i1);
    c2 = _mm256_add_epi32(c2, i2);
  }
  alignas(32) int32_t ints[8];
  int32_t s1 = 0, s2 = 0;
  _mm256_store_si256(reinterpret_cast<__m256i*>(ints), c1);
  for (int32_t v : ints) s1 += v;
  _mm256_store_si256(reinterpret_cast<__m256i*>(ints), c2);
  for (int32_t v : ints) s2 += v;
  split_range(r, vec, group, inv, q1, q2, s1, s2);
  return {amax / 127.f, sum, s1, s2};
}
#endif

#if defined(__x86_64__)
// f + s * (dx * d1 + dx / 254 * d2): one group's contribution to 16 outputs from its integer sums d1 = x1 . w and
// d2 = x2 . w (weight offsets already taken out), s the group's 16 weight scales. The VNNI tiles and the AMX
// tiles (amx_dot_gemm.cpp) both scale through here, which is why they give the same floats.
__attribute__((target("avx512f"), always_inline)) inline __m512 add_scaled_sums(__m512 f, __m512i d1, __m512i d2,
                                                                                float dx, __m512 s) {
  __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(d1), _mm512_set1_ps(dx));
  t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d2), _mm512_set1_ps(dx / RESIDUAL_STEPS), t);
  return _mm512_fmadd_ps(t, s, f);
}
#endif

// How quantize_activations splits a group: the portable loop, or 8 / 16 k at a time (the caller's tiles' ISA).
enum class Split { kScalar, kAvx2, kAvx512 };

inline void quantize_activations(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, Activations& a,
                                 Split split) {
  const int64_t G = K / group;
  a.x1.resize(static_cast<size_t>(M * K));
  a.x2.resize(static_cast<size_t>(M * K));
  a.d.resize(static_cast<size_t>(M * G));
  a.s.resize(static_cast<size_t>(M * G));
  a.s1.resize(static_cast<size_t>(M * G));
  a.s2.resize(static_cast<size_t>(M * G));
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < G; ++g) {
        const float* r = x + m * ldx + g * group;
        int8_t* q1 = a.x1.data() + m * K + g * group;
        int8_t* q2 = a.x2.data() + m * K + g * group;
#if defined(__x86_64__)
        const GroupStats st = split == Split::kAvx512 ? split_group_avx512(r, group, q1, q2)
                              : split == Split::kAvx2 ? split_group_avx2(r, group, q1, q2)
                                                      : split_group_generic(r, group, q1, q2);
#else
        const GroupStats st = split_group_generic(r, group, q1, q2);
#endif
        a.d[m * G + g] = st.d;
        a.s[m * G + g] = st.sum;
        a.s1[m * G + g] = st.s1;
        a.s2[m * G + g] = st.s2;
      }
    }
  });
}

// y[M, N] (+ bias) from tiles: tile(p, m0, rows, acc) writes rows x 16 results of panel p, rows m0.., into acc
// [rows][16]. Threads split the panels; at least ~256k multiply-adds each, so small matmuls stay on one thread.
// Row blocks of int8 x (two terms) of ~128 KiB stay in L2 across a thread's panels; a panel stays in L1 across
// a block's row tiles.
template <typename Tile>
void for_each_tile(int64_t M, int64_t N, int64_t K, const float* bias, float* y, int64_t ldy, const Tile& tile) {
  const int64_t P = (N + NR - 1) / NR;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, M * K * NR));
  const int64_t mblock = std::max<int64_t>(MR, (64 * 1024) / K / MR * MR);
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    float tmp[MR * NR];
    for (int64_t mb = 0; mb < M; mb += mblock)
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
        const int64_t me = std::min(M, mb + mblock);
        for (int64_t m = mb; m < me; m += MR) {
          const int rows = static_cast<int>(std::min<int64_t>(MR, me - m));
          tile(p, m, rows, tmp);
          for (int i = 0; i < rows; ++i) {
            float* yr = y + (m + i) * ldy + n0;
            const float* t = tmp + i * NR;
            if (bias != nullptr) {
              for (int64_t j = 0; j < cols; ++j) yr[j] = t[j] + bias[n0 + j];
            } else {
              std::memcpy(yr, t, sizeof(float) * cols);
            }
          }
        }
      }
  });
}

}  // namespace dot_gemm
