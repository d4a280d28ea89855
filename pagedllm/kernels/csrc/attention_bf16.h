// The bf16 pieces of paged attention (paged_attention.cpp) for a bf16 query against a bf16 cache:
//
// - Scores on AMX tiles. The scores of one KV head's G query heads against 16 keys are C [16 keys, G] = A . B with
//   A the 16 key rows straight from the cache (32 dims a tile, the cache's row stride) and B the query as tdpbf16ps
//   wants it (pairs of dims: [16 pairs, G, 2]), packed once per token. One tdpbf16ps does the 16 x G x 32
//   multiply-adds of 16 G vdpbf16ps, and no reduction tree per key and head follows; C comes back key-major and
//   is gathered into the head-major score rows.
// - The weighted sum of V rows by vdpbf16ps over pairs of keys: the probabilities rounded to bf16 (as PyTorch's
//   flash attention does before its P . V matmul) and two V rows interleaved by unpacklo/hi, so each instruction
//   adds two keys' products in 16 float lanes without widening V. The interleave permutes the dims within each
//   32: the accumulators stay permuted until unpermute_pairs restores the order once per token.
#pragma once
#include "amx_tiles.h"
#include "head_tiles.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(PAGEDLLM_AMX)
#include <immintrin.h>
#endif

namespace attention_bf16 {

constexpr int64_t TILE_KEYS = 16;  // key rows in one A tile
constexpr int64_t PAIRS = 16;      // pairs of dims in one tile pass: 32 dims

// q [HG, D] bf16 (HG = KV heads x G) -> pairs [HG / G, D / 32, 16, G] of 32-bit (two bf16 dims each): B tiles.
inline void pack_query_pairs(const at::BFloat16* q, int64_t HG, int64_t G, int64_t D, uint32_t* pairs) {
  const int64_t chunks = D / (2 * PAIRS);
  for (int64_t hh = 0; hh < HG / G; ++hh)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t p = 0; p < PAIRS; ++p)
        for (int64_t g = 0; g < G; ++g) {
          uint32_t two;
          std::memcpy(&two, q + (hh * G + g) * D + 2 * (c * PAIRS + p), 4);
          pairs[((hh * chunks + c) * PAIRS + p) * G + g] = two;
        }
}

#if defined(PAGEDLLM_AMX)
// The tiles score_rows_amx uses: C (tmm0) [16, G] float, A (tmm1) 16 key rows x 32 dims, B (tmm2) [16 pairs, G].
inline amx_tiles::TileConfig score_tiles(int64_t G) {
  amx_tiles::TileConfig cfg;
  cfg.rows[0] = TILE_KEYS, cfg.colsb[0] = static_cast<uint16_t>(4 * G);
  cfg.rows[1] = TILE_KEYS, cfg.colsb[1] = 4 * PAIRS;
  cfg.rows[2] = PAIRS, cfg.colsb[2] = static_cast<uint16_t>(4 * G);
  return cfg;
}

// scores[g * stride + i] = scale * q_g . rows[i] for the G query heads of one KV head and i < n (pairs: that head's
// packed query). Reads whole 16-row tiles: every 16-row span from `rows` must be readable (a block of a multiple of
// 16 slots; rows past n are never written out). The tiles must be configured with score_tiles(G).
__attribute__((target("amx-tile,amx-bf16,avx512f"))) inline void score_rows_amx(
    const uint32_t* pairs, int64_t G, int64_t D, const at::BFloat16* rows, int64_t row_stride, int64_t n,
    float scale, float* scores, int64_t stride) {
  alignas(64) float c[TILE_KEYS * 16];
  const __m512i key_rows = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(static_cast<int>(G)));
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < n; i0 += TILE_KEYS) {
    _tile_zero(0);
    for (int64_t d = 0; d < D; d += 2 * PAIRS) {
      _tile_loadd(1, rows + i0 * row_stride + d, row_stride * 2);
      _tile_loadd(2, pairs + (d / 2) * G, G * 4);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, G * 4);
    asm volatile("" ::: "memory");  // GCC's _tile_stored declares no memory write
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(TILE_KEYS, n - i0)) - 1);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 col = _mm512_i32gather_ps(_mm512_add_epi32(key_rows, _mm512_set1_epi32(static_cast<int>(g))), c, 4);
      _mm512_mask_storeu_ps(scores + g * stride + i0, valid, _mm512_mul_ps(col, s));
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// out[0 .. n) = bf16(p[0 .. n)), rounded to nearest even, and out[n] = 0 when n is odd (the partner of the last key).
inline void round_to_bf16(const float* p, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + i)));
  }
  if (n % 2) out[n] = 0;
}

// acc[g, permuted dims d0 .. d0 + 32 CH) += sum_i p[g, i] * rows[i, same dims], keys taken in pairs: pp[g * pstride
// + i / 2] holds bf16 p[g, i] and p[g, i + 1]. An odd last key is paired with zeros.
template <int GT, int CH>
inline void accumulate_pair_chunks(const uint32_t* pp, int64_t pstride, const at::BFloat16* rows,
                                   int64_t row_stride, int64_t n, int64_t D, int64_t d0, float* acc) {
  __m512 a[GT][CH][2];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < CH; ++c)
      for (int e = 0; e < 2; ++e) a[g][c][e] = _mm512_loadu_ps(acc + g * D + d0 + 32 * c + 16 * e);
  for (int64_t i = 0; i < n; i += 2) {
    const at::BFloat16* r0 = rows + i * row_stride + d0;
    __m512bh v[CH][2];
    for (int c = 0; c < CH; ++c) {
      const __m512i x = _mm512_loadu_si512(r0 + 32 * c);
      const __m512i y = i + 1 < n ? _mm512_loadu_si512(r0 + row_stride + 32 * c) : _mm512_setzero_si512();
      v[c][0] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      v[c][1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < GT; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g * pstride + i / 2]));
      for (int c = 0; c < CH; ++c)
        for (int e = 0; e < 2; ++e) a[g][c][e] = _mm512_dpbf16_ps(a[g][c][e], v[c][e], w);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < CH; ++c)
      for (int e = 0; e < 2; ++e) _mm512_storeu_ps(acc + g * D + d0 + 32 * c + 16 * e, a[g][c][e]);
}

template <int GT>
inline void accumulate_pair_rows(const uint32_t* pp, int64_t pstride, const at::BFloat16* rows, int64_t row_stride,
                                 int64_t n, int64_t D, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // up to 2 x 32 dims per sweep over the rows
    if (D - d0 >= 64) {
      accumulate_pair_chunks<GT, 2>(pp, pstride, rows, row_stride, n, D, d0, acc);
    } else {
      accumulate_pair_chunks<GT, 1>(pp, pstride, rows, row_stride, n, D, d0, acc);
    }
  }
}

// accumulate_pair_rows over the G query heads of one KV head, in tiles (head_tiles.h).
inline void accumulate_heads_pairs(const uint16_t* p, int64_t stride, int64_t G, const at::BFloat16* rows,
                                   int64_t row_stride, int64_t n, int64_t D, float* acc) {
  head_tiles::for_each(G, [&](auto T, int64_t g0) PAGEDLLM_INLINE_TILE {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(p + g0 * stride);
    accumulate_pair_rows<decltype(T)::value>(pairs, stride / 2, rows, row_stride, n, D, acc + g0 * D);
  });
}

// Each 32 dims of acc [rows, D] back in order: unpacklo left dims 8l .. 8l + 3 of 128-bit lane l in lanes 4l .. 4l + 3
// of the first 16 floats, unpackhi dims 8l + 4 .. 8l + 7 in the second 16.
inline void unpermute_pairs(float* acc, int64_t rows, int64_t D) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 32) {
      float* x = acc + r * D + d;
      const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
      _mm512_storeu_ps(x, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}
#endif

}  // namespace attention_bf16
