// The byte-dot-product matmuls on AMX tiles (amx_dot.h). Why: a prompt of a few hundred tokens through the 4-bit
// default model ran its matmuls at ~300 GFLOP/s on VNNI on an Intel Xeon (two cores), a third of a speculative
// request's time; one tdpbsud does 16 x 16 x 64 multiply-adds where vpdpbusd does 64.
//
// A tile pass covers 16 rows x one panel (16 columns) x one weight group:
//   tmm0, tmm1  x1, x2 of 16 rows, kc bytes each (kc: the largest multiple of 4 up to 64 dividing the group)
//   tmm2        the panel's weights for those kc k, as tdpbsud wants them: kc / 4 rows of 64 bytes, 4 k of each
//               column per 32-bit lane. That is the dot4 layout as stored; 4-bit dot8 blocks are unpacked into it
//               once per panel (low nibbles: k 8b..8b+3, high: 8b+4..8b+7).
//   tmm4, tmm5  the int32 sums x1 . w and x2 . w of even groups, tmm6, tmm7 of odd ones: stored after each group
//               and scaled into float accumulators with the VNNI tiles' arithmetic (the same operations in the
//               same order, so the results are equal), while the tiles already sum the next group.
// tdpbsud multiplies signed bytes (x) by unsigned ones (levels 0..15, or q + 128 whose offset comes out through
// the integer sums of x1 and x2, as in q8_dot_gemm.cpp).
//
// Measured on an Intel Xeon (family 6 model 167, AMX), 2 threads, 256 rows: the default model's 4-bit matmuls
// 1.5-1.9x faster than the VNNI tiles (gate/up 3072 x 576: 1.93 against 3.56 ms). Storing each group's sums
// (a 32-k group per tile pass) and scaling them bounds it, not the multiply-adds. Up to ~8 rows the VNNI tiles
// win: 5 rows measured 0.153 (AMX) against 0.173 ms (VNNI) a layer with the weights in cache, but 6.5 against 5.2 ms
// a step inside real steps verifying 4 drafts, the weights streaming from memory; the autotuner's bucket of 3-8 rows,
// timed at 4, keeps VNNI.
#include "amx_dot.h"
#include "amx_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(PAGEDLLM_AMX)
#include <immintrin.h>
#endif

namespace amx_dot {
namespace {

using dot_gemm::Activations;
using dot_gemm::NR;
constexpr int64_t TILE_M = 16;    // rows per tile pass
constexpr int64_t ROW_BYTES = 64;  // one B tile row: 4 k of 16 columns
constexpr int32_t OFFSET = 128;    // dot4 levels are q + 128

#if defined(PAGEDLLM_AMX)
using amx_tiles::TileConfig;

TileConfig tile_config(int64_t mr, int64_t kc) {
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) cfg.rows[t] = static_cast<uint8_t>(mr), cfg.colsb[t] = static_cast<uint16_t>(kc);
  cfg.rows[2] = static_cast<uint8_t>(kc / 4), cfg.colsb[2] = ROW_BYTES;  // tile 3 stays unconfigured: unused
  for (int t = 4; t < 8; ++t) cfg.rows[t] = static_cast<uint8_t>(mr), cfg.colsb[t] = ROW_BYTES;
  return cfg;
}

// k per tile pass: the largest multiple of 4 up to 64 that divides the group (32 for GGUF's blocks).
int64_t chunk_of(int64_t group) {
  for (int64_t kc = 64; kc > 4; kc -= 4)
    if (group % kc == 0) return kc;
  return 4;
}

// A dot8 panel [K/8][64] -> rows [K/4][64]: block b's low nibbles are row 2b, its high nibbles row 2b + 1.
__attribute__((target("avx512f,avx512bw"))) void unpack_nibbles(const uint8_t* panel, int64_t K, uint8_t* rows) {
  const __m512i mask = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < K / 8; ++b) {
    const __m512i v = _mm512_loadu_si512(panel + b * 64);
    _mm512_storeu_si512(rows + (2 * b) * ROW_BYTES, _mm512_and_si512(v, mask));
    _mm512_storeu_si512(rows + (2 * b + 1) * ROW_BYTES, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  }
}

// f + s * (dx * d1 + dx / 254 * d2): one group's contribution to 16 outputs from its integer sums d1 = x1 . w and
// d2 = x2 . w (weight offsets already taken out), s the group's 16 weight scales: simd/dot_tiles.h's
// add_scaled_sums, the same operations in the same order, which is why AMX and the VNNI tiles give the same floats.
__attribute__((target("avx512f"), always_inline)) inline __m512 add_scaled_sums(__m512 f, __m512i d1, __m512i d2,
                                                                                float dx, __m512 s) {
  __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(d1), _mm512_set1_ps(dx));
  t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d2), _mm512_set1_ps(dx / dot_gemm::RESIDUAL_STEPS), t);
  return _mm512_fmadd_ps(t, s, f);
}

// f[i] += group g of panel p for rows m0 + i < m0 + mr, from its stored sums c1 = x1 . w, c2 = x2 . w [16][16]
// int32, offsets and min term as the VNNI tiles (simd/dot_tiles.h) take them, scaled as they scale them.
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"), always_inline)) inline void scale_group(
    const Activations& a, const Weights& wt, int64_t p, int64_t g, int64_t G, int64_t m0, int64_t mr,
    const int32_t* c1, const int32_t* c2, __m512 (&f)[TILE_M]) {
  const int64_t o = (p * G + g) * NR;
  const __m512 s = wt.half_scales
                       ? _mm512_cvtph_ps(_mm256_loadu_si256(
                             reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(wt.scales) + o)))
                       : _mm512_loadu_ps(static_cast<const float*>(wt.scales) + o);
  const __m512 n = wt.mins != nullptr
                       ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt.mins + o)))
                       : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int64_t i = 0; i < TILE_M; ++i) {
    if (i >= mr) break;
    const int64_t ro = (m0 + i) * G + g;
    __m512i d1 = _mm512_load_si512(c1 + i * NR), d2 = _mm512_load_si512(c2 + i * NR);
    if (!wt.nibbles) {
      d1 = _mm512_sub_epi32(d1, _mm512_set1_epi32(OFFSET * a.s1[ro]));
      d2 = _mm512_sub_epi32(d2, _mm512_set1_epi32(OFFSET * a.s2[ro]));
    }
    const __m512 prev = wt.mins != nullptr ? _mm512_fmadd_ps(n, _mm512_set1_ps(a.s[ro]), f[i]) : f[i];
    f[i] = add_scaled_sums(prev, d1, d2, a.d[ro], s);
  }
}

// x1 . w and x2 . w of one group (k0 .. k0 + group in passes of kc) into tiles C1, C2 (zeroed first).
#define PAGEDLLM_AMX_GROUP(C1, C2)                                    \
  do {                                                                \
    _tile_zero(C1);                                                   \
    _tile_zero(C2);                                                   \
    for (int64_t k = k0; k < k0 + group; k += kc) {                   \
      _tile_loadd(0, x1 + m0 * K + k, K);                             \
      _tile_loadd(1, x2 + m0 * K + k, K);                             \
      _tile_loadd(2, rows + (k / 4) * ROW_BYTES, ROW_BYTES);          \
      _tile_dpbsud(C1, 0, 2);                                         \
      _tile_dpbsud(C2, 1, 2);                                         \
    }                                                                 \
  } while (0)

// Panels [p0, p1): every row of x against each. Groups alternate between tiles 4, 5 and 6, 7 so that the tiles
// sum group g + 1 while the vector units scale group g.
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c,fma"))) void run_panels(
    const Activations& a, int64_t M, int64_t N, int64_t K, int64_t group, const Weights& wt, const float* bias,
    float* y, int64_t ldy, int64_t p0, int64_t p1) {
  const int64_t G = K / group, kc = chunk_of(group);
  std::vector<uint8_t> unpacked(wt.nibbles ? static_cast<size_t>((K / 4) * ROW_BYTES) : 0);
  alignas(64) int32_t sums[4][TILE_M * NR];
  const int8_t* x1 = a.x1.data();
  const int8_t* x2 = a.x2.data();
  int64_t configured = -1;  // the rows the loaded tile configuration has
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* rows = wt.w + p * wt.panel_bytes;
    if (wt.nibbles) {
      unpack_nibbles(rows, K, unpacked.data());
      rows = unpacked.data();
      // GCC's _tile_loadd declares no memory read: the unpacked rows must be stored before the tiles load them.
      asm volatile("" ::: "memory");
    }
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
      const int64_t mr = std::min(TILE_M, M - m0);
      if (mr != configured) {
        const TileConfig cfg = tile_config(mr, kc);
        PAGEDLLM_LOAD_TILE_CONFIG(cfg);
        configured = mr;
      }
      __m512 f[TILE_M];
      for (int64_t i = 0; i < TILE_M; ++i) f[i] = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; g += 2) {
        int64_t k0 = g * group;
        PAGEDLLM_AMX_GROUP(4, 5);
        if (g + 1 < G) {
          k0 += group;
          PAGEDLLM_AMX_GROUP(6, 7);
        }
        _tile_stored(4, sums[0], NR * 4);
        _tile_stored(5, sums[1], NR * 4);
        scale_group(a, wt, p, g, G, m0, mr, sums[0], sums[1], f);
        if (g + 1 < G) {
          _tile_stored(6, sums[2], NR * 4);
          _tile_stored(7, sums[3], NR * 4);
          scale_group(a, wt, p, g + 1, G, m0, mr, sums[2], sums[3], f);
        }
      }
      alignas(64) float t[NR];
      for (int64_t i = 0; i < mr; ++i) {
        float* yr = y + (m0 + i) * ldy + n0;
        _mm512_store_ps(t, f[i]);
        if (bias != nullptr) {
          for (int64_t c = 0; c < cols; ++c) yr[c] = t[c] + bias[n0 + c];
        } else {
          std::memcpy(yr, t, sizeof(float) * cols);
        }
      }
    }
  }
  _tile_release();
}
#undef PAGEDLLM_AMX_GROUP
#endif

}  // namespace

bool supported() { return amx_tiles::int8_supported(); }

void gemm(const Activations& a, int64_t M, int64_t N, int64_t K, int64_t group, const Weights& wt,
          const float* bias, float* y, int64_t ldy) {
  TORCH_CHECK(supported(), "AMX tiles are not available on this CPU (or the kernel refused the tile state)");
#if defined(PAGEDLLM_AMX)
  const int64_t P = (N + NR - 1) / NR;
  // As tile_loop.h's dot_tile_loop: at least ~256k multiply-adds a task, so small matmuls stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, M * K * NR));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) { run_panels(a, M, N, K, group, wt, bias, y, ldy, p0, p1); });
#endif
}

}  // namespace amx_dot
