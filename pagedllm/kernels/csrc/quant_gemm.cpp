// Weight-only quantized matmuls: y[M, N] = x[M, K] @ dequant(W)^T (+ bias), x and y float32.
//
// Weights are repacked once at load time into panels of 16 output columns (like packed_gemm.cpp) so the
// inner loop reads one contiguous stream per panel and widens 16 weights per k into vector lanes:
//   q8: int8 [P, K, 16], w = scale[g] * q                        (int8 per channel, GGUF Q8_0, 8-bit GPTQ)
//   q4: uint8 [P, K/2, 16] (byte j of k pair t: low nibble k = 2t, high nibble k = 2t + 1),
//       w = scale[g] * q + min[g]                                (int4, GGUF Q4_0/Q4_1, 4-bit GPTQ/AWQ)
//   f8: uint8 [P, K, 16] float8 e4m3fn bit patterns, w = scale[g] * fp8(q)   (fp8 per channel or block)
// with scale/min float32 [P, K/group, 16]. A group's products are summed in float, then scaled once; the
// q4 minimum contributes min * sum(x over the group), from a per-call table of group sums of x. From
// DEQUANT_MIN_ROWS rows on, each panel is instead dequantized into a float buffer and multiplied in float:
// with AVX-512 by 8-row x 16-column zmm tiles reading x in place; elsewhere by the fp32 panel kernel of
// packed_gemm.cpp on x packed once per call (packed_panels.h), so many rows cost what fp32 weights cost.
//
// fp8 -> float in registers: the byte s eeee mmm placed in a 16-bit lane as s 0 eeee mmm 0000000 is the
// float16 of value * 2^-8 (normals and subnormals alike: e4m3's exponent bias 7 vs float16's 15), which
// F16C / AVX-512 convert to float exactly; the 2^8 goes into the scale. The portable path uses a table.
// e4m3fn's NaN pattern (s 1111 111) reads as +-480: quantizers clamp to +-448 and never produce it.
//
// ISA dispatch is at run time, per call (isa: 0 = best available, 1 = AVX2+FMA+F16C, 2 = AVX-512F/BW/VL,
// 3 = portable C++), so one build serves both CPU kinds and tests can force every path on one machine.
// The x86 paths are compiled with function-level target attributes, not with the build's -march (the
// fp32 panel kernel used for many rows off AVX-512 is packed_gemm.cpp's, built for the build's -march).
#include "cpu_features.h"
#include "gemm_args.h"
#include "kernels.h"
#include "packed_panels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define PAGEDLLM_X86 1
#endif

namespace {

constexpr int64_t NR = 16;  // output columns per panel
// int8 tiles prefetch 4 KiB ahead (a line every 4 k): one decode row streams the weight from memory, and the
// hardware prefetcher alone left the tied LM head of the default model at about half the memory bandwidth.
constexpr int64_t Q8_PREFETCH_BYTES = 4096;
// Everything one call's tiles need. Tiles compute R rows x 16 columns of one panel into tmp[R][16]
// (scaled, without bias); the caller adds bias and stores the panel's valid columns.
struct Problem {
  const float* x;       // [M, ldx]
  int64_t ldx;
  const uint8_t* w;     // panel p at w + p * panel_bytes
  int64_t panel_bytes;
  const float* scales;  // [P, G, 16]
  const float* mins;    // [P, G, 16] (q4 only)
  const float* xsum;    // [M, G] (q4 only)
  int64_t K, G, group;
};

// ---------------------------------------------------------------- portable
void q8_tile_generic(const Problem& pb, int64_t p, int64_t m0, int rows, float* tmp) {
  const int8_t* panel = reinterpret_cast<const int8_t*>(pb.w + p * pb.panel_bytes);
  for (int i = 0; i < rows; ++i) {
    const float* x = pb.x + (m0 + i) * pb.ldx;
    for (int j = 0; j < NR; ++j) {
      float acc = 0.f;
      for (int64_t g = 0; g < pb.G; ++g) {
        float c = 0.f;
        for (int64_t k = g * pb.group; k < (g + 1) * pb.group; ++k) c += x[k] * panel[k * NR + j];
        acc += c * pb.scales[(p * pb.G + g) * NR + j];
      }
      tmp[i * NR + j] = acc;
    }
  }
}

void q4_tile_generic(const Problem& pb, int64_t p, int64_t m0, int rows, float* tmp) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  for (int i = 0; i < rows; ++i) {
    const float* x = pb.x + (m0 + i) * pb.ldx;
    for (int j = 0; j < NR; ++j) {
      float acc = 0.f;
      for (int64_t g = 0; g < pb.G; ++g) {
        float c = 0.f;
        for (int64_t k = g * pb.group; k < (g + 1) * pb.group; ++k) {
          const uint8_t b = panel[(k / 2) * NR + j];
          c += x[k] * static_cast<float>((k & 1) ? (b >> 4) : (b & 15));
        }
        const int64_t s = (p * pb.G + g) * NR + j;
        acc += c * pb.scales[s] + pb.xsum[(m0 + i) * pb.G + g] * pb.mins[s];
      }
      tmp[i * NR + j] = acc;
    }
  }
}

// float8 e4m3fn bits -> float (sign, 4-bit exponent with bias 7, 3-bit mantissa; exponent 0: subnormal).
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(static_cast<float>(8 + m), e - 10);
      t[b] = (b & 128) ? -v : v;
    }
    return t;
  }();
  return table;
}

void f8_tile_generic(const Problem& pb, int64_t p, int64_t m0, int rows, float* tmp) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const float* f8 = fp8_table().data();
  for (int i = 0; i < rows; ++i) {
    const float* x = pb.x + (m0 + i) * pb.ldx;
    for (int j = 0; j < NR; ++j) {
      float acc = 0.f;
      for (int64_t g = 0; g < pb.G; ++g) {
        float c = 0.f;
        for (int64_t k = g * pb.group; k < (g + 1) * pb.group; ++k) c += x[k] * f8[panel[k * NR + j]];
        acc += c * pb.scales[(p * pb.G + g) * NR + j];
      }
      tmp[i * NR + j] = acc;
    }
  }
}

#if defined(PAGEDLLM_X86)
// ---------------------------------------------------------------- AVX2 + FMA: 16 columns = 2 registers
template <int R>
__attribute__((target("avx2,fma"))) void q8_tile_avx2(const Problem& pb, int64_t p, int64_t m0, float* tmp) {
  const int8_t* panel = reinterpret_cast<const int8_t*>(pb.w + p * pb.panel_bytes);
  const float* xr = pb.x + m0 * pb.ldx;
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < pb.G; ++g) {
    __m256 c[R][2];
    for (int i = 0; i < R; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
    const int64_t k1 = (g + 1) * pb.group;
#pragma GCC unroll 4
    for (int64_t k = g * pb.group; k < k1; ++k) {
      if ((k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + k * NR + Q8_PREFETCH_BYTES), _MM_HINT_T0);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * NR));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_broadcast_ss(xr + i * pb.ldx + k);
        c[i][0] = _mm256_fmadd_ps(xv, w0, c[i][0]);
        c[i][1] = _mm256_fmadd_ps(xv, w1, c[i][1]);
      }
    }
    const float* s = pb.scales + (p * pb.G + g) * NR;
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    for (int i = 0; i < R; ++i) {
      acc[i][0] = _mm256_fmadd_ps(c[i][0], s0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(c[i][1], s1, acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(tmp + i * NR, acc[i][0]);
    _mm256_storeu_ps(tmp + i * NR + 8, acc[i][1]);
  }
}

template <int R>
__attribute__((target("avx2,fma"))) void q4_tile_avx2(const Problem& pb, int64_t p, int64_t m0, float* tmp) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const float* xr = pb.x + m0 * pb.ldx;
  const __m128i low = _mm_set1_epi8(15);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < pb.G; ++g) {
    __m256 c[R][2];
    for (int i = 0; i < R; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
    const int64_t k1 = (g + 1) * pb.group;
#pragma GCC unroll 2
    for (int64_t k = g * pb.group; k < k1; k += 2) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + (k / 2) * NR));
      const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      const __m256 e0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      const __m256 e1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      const __m256 o0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      const __m256 o1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      for (int i = 0; i < R; ++i) {
        const __m256 xe = _mm256_broadcast_ss(xr + i * pb.ldx + k);
        const __m256 xo = _mm256_broadcast_ss(xr + i * pb.ldx + k + 1);
        c[i][0] = _mm256_fmadd_ps(xe, e0, c[i][0]);
        c[i][1] = _mm256_fmadd_ps(xe, e1, c[i][1]);
        c[i][0] = _mm256_fmadd_ps(xo, o0, c[i][0]);
        c[i][1] = _mm256_fmadd_ps(xo, o1, c[i][1]);
      }
    }
    const int64_t s = (p * pb.G + g) * NR;
    const __m256 s0 = _mm256_loadu_ps(pb.scales + s), s1 = _mm256_loadu_ps(pb.scales + s + 8);
    const __m256 n0 = _mm256_loadu_ps(pb.mins + s), n1 = _mm256_loadu_ps(pb.mins + s + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 xs = _mm256_broadcast_ss(pb.xsum + (m0 + i) * pb.G + g);
      acc[i][0] = _mm256_fmadd_ps(c[i][0], s0, _mm256_fmadd_ps(xs, n0, acc[i][0]));
      acc[i][1] = _mm256_fmadd_ps(c[i][1], s1, _mm256_fmadd_ps(xs, n1, acc[i][1]));
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(tmp + i * NR, acc[i][0]);
    _mm256_storeu_ps(tmp + i * NR + 8, acc[i][1]);
  }
}

// 16 fp8 bytes -> two float vectors of value * 2^-8 (see the header).
__attribute__((target("avx2,fma,f16c"))) inline void fp8x16_avx2(__m128i b, __m256& w0, __m256& w1) {
  const __m128i zero = _mm_setzero_si128(), keep = _mm_set1_epi16(static_cast<int16_t>(0xBFFF));
  w0 = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(zero, b), 1), keep));
  w1 = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(zero, b), 1), keep));
}

template <int R>
__attribute__((target("avx2,fma,f16c"))) void f8_tile_avx2(const Problem& pb, int64_t p, int64_t m0, float* tmp) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const float* xr = pb.x + m0 * pb.ldx;
  const __m256 two8 = _mm256_set1_ps(256.f);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < pb.G; ++g) {
    __m256 c[R][2];
    for (int i = 0; i < R; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
    const int64_t k1 = (g + 1) * pb.group;
#pragma GCC unroll 4
    for (int64_t k = g * pb.group; k < k1; ++k) {
      __m256 w0, w1;
      fp8x16_avx2(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * NR)), w0, w1);
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_broadcast_ss(xr + i * pb.ldx + k);
        c[i][0] = _mm256_fmadd_ps(xv, w0, c[i][0]);
        c[i][1] = _mm256_fmadd_ps(xv, w1, c[i][1]);
      }
    }
    const float* s = pb.scales + (p * pb.G + g) * NR;
    const __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(s), two8), s1 = _mm256_mul_ps(_mm256_loadu_ps(s + 8), two8);
    for (int i = 0; i < R; ++i) {
      acc[i][0] = _mm256_fmadd_ps(c[i][0], s0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(c[i][1], s1, acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(tmp + i * NR, acc[i][0]);
    _mm256_storeu_ps(tmp + i * NR + 8, acc[i][1]);
  }
}

// ---------------------------------------------------------------- AVX-512: 16 columns = 1 register
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void q8_tile_avx512(const Problem& pb, int64_t p,
                                                                        int64_t m0, float* tmp) {
  const int8_t* panel = reinterpret_cast<const int8_t*>(pb.w + p * pb.panel_bytes);
  const float* xr = pb.x + m0 * pb.ldx;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < pb.G; ++g) {
    __m512 c[R];
    for (int i = 0; i < R; ++i) c[i] = _mm512_setzero_ps();
    const int64_t k1 = (g + 1) * pb.group;
#pragma GCC unroll 4
    for (int64_t k = g * pb.group; k < k1; ++k) {
      if ((k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + k * NR + Q8_PREFETCH_BYTES), _MM_HINT_T0);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * NR));
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
      for (int i = 0; i < R; ++i) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i * pb.ldx + k]), w, c[i]);
    }
    const __m512 s = _mm512_loadu_ps(pb.scales + (p * pb.G + g) * NR);
    for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(c[i], s, acc[i]);
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(tmp + i * NR, acc[i]);
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void q4_tile_avx512(const Problem& pb, int64_t p,
                                                                        int64_t m0, float* tmp) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const float* xr = pb.x + m0 * pb.ldx;
  const __m128i low = _mm_set1_epi8(15);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < pb.G; ++g) {
    __m512 c[R];
    for (int i = 0; i < R; ++i) c[i] = _mm512_setzero_ps();
    const int64_t k1 = (g + 1) * pb.group;
#pragma GCC unroll 2
    for (int64_t k = g * pb.group; k < k1; k += 2) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + (k / 2) * NR));
      const __m512 we = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low)));
      const __m512 wo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)));
      for (int i = 0; i < R; ++i) {
        c[i] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i * pb.ldx + k]), we, c[i]);
        c[i] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i * pb.ldx + k + 1]), wo, c[i]);
      }
    }
    const int64_t s = (p * pb.G + g) * NR;
    const __m512 sv = _mm512_loadu_ps(pb.scales + s), nv = _mm512_loadu_ps(pb.mins + s);
    for (int i = 0; i < R; ++i) {
      const __m512 xs = _mm512_set1_ps(pb.xsum[(m0 + i) * pb.G + g]);
      acc[i] = _mm512_fmadd_ps(c[i], sv, _mm512_fmadd_ps(xs, nv, acc[i]));
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(tmp + i * NR, acc[i]);
}
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void f8_tile_avx512(const Problem& pb, int64_t p,
                                                                        int64_t m0, float* tmp) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const float* xr = pb.x + m0 * pb.ldx;
  const __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < pb.G; ++g) {
    __m512 c[R];
    for (int i = 0; i < R; ++i) c[i] = _mm512_setzero_ps();
    const int64_t k1 = (g + 1) * pb.group;
#pragma GCC unroll 4
    for (int64_t k = g * pb.group; k < k1; ++k) {
      const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * NR)));
      const __m512 w = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(h, 8), 1), keep));
      for (int i = 0; i < R; ++i) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i * pb.ldx + k]), w, c[i]);
    }
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(pb.scales + (p * pb.G + g) * NR), _mm512_set1_ps(256.f));
    for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(c[i], s, acc[i]);
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(tmp + i * NR, acc[i]);
}
#endif

// ---------------------------------------------------------------- many rows: dequantize, then fp32 tiles
// Past one register tile of rows, widening every weight once per row tile costs more than the multiply-adds;
// instead each panel is dequantized into a float buffer [K, 16] once per row block and all its rows multiply it.
constexpr int64_t DEQUANT_MIN_ROWS = 9;  // one 8-row AVX-512 tile still reads the weights directly

enum class Fmt { Q8, Q4, F8 };

void dequant_panel_generic(Fmt fmt, const Problem& pb, int64_t p, float* dst) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  for (int64_t g = 0; g < pb.G; ++g) {
    const float* s = pb.scales + (p * pb.G + g) * NR;
    const float* m = fmt == Fmt::Q4 ? pb.mins + (p * pb.G + g) * NR : nullptr;
    for (int64_t k = g * pb.group; k < (g + 1) * pb.group; ++k) {
      float* d = dst + k * NR;
      for (int j = 0; j < NR; ++j) {
        if (fmt == Fmt::Q4) d[j] = static_cast<float>((panel[(k / 2) * NR + j] >> ((k & 1) * 4)) & 15) * s[j] + m[j];
        else if (fmt == Fmt::Q8) d[j] = static_cast<float>(reinterpret_cast<const int8_t*>(panel)[k * NR + j]) * s[j];
        else d[j] = fp8_table()[panel[k * NR + j]] * s[j];
      }
    }
  }
}

#if defined(PAGEDLLM_X86)
// One panel -> float [K, 16] with AVX2 (also used on AVX-512 CPUs: a small share of the many-row time).
template <Fmt F>
__attribute__((target("avx2,fma,f16c"))) void dequant_panel_avx2(const Problem& pb, int64_t p, float* dst) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t g = 0; g < pb.G; ++g) {
    const float* sp = pb.scales + (p * pb.G + g) * NR;
    __m256 s0 = _mm256_loadu_ps(sp), s1 = _mm256_loadu_ps(sp + 8);
    if (F == Fmt::F8) s0 = _mm256_mul_ps(s0, _mm256_set1_ps(256.f)), s1 = _mm256_mul_ps(s1, _mm256_set1_ps(256.f));
    const int64_t k1 = (g + 1) * pb.group;
    if (F == Fmt::Q4) {
      const float* mp = pb.mins + (p * pb.G + g) * NR;
      const __m256 n0 = _mm256_loadu_ps(mp), n1 = _mm256_loadu_ps(mp + 8);
      for (int64_t k = g * pb.group; k < k1; k += 2) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + (k / 2) * NR));
        const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        float* d = dst + k * NR;
        _mm256_storeu_ps(d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s0, n0));
        _mm256_storeu_ps(d + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                                                s1, n1));
        _mm256_storeu_ps(d + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s0, n0));
        _mm256_storeu_ps(d + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
                                                 s1, n1));
      }
    } else {
      for (int64_t k = g * pb.group; k < k1; ++k) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * NR));
        __m256 w0, w1;
        if (F == Fmt::Q8) {
          w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
          w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
        } else {
          fp8x16_avx2(b, w0, w1);
        }
        _mm256_storeu_ps(dst + k * NR, _mm256_mul_ps(w0, s0));
        _mm256_storeu_ps(dst + k * NR + 8, _mm256_mul_ps(w1, s1));
      }
    }
  }
}
#endif

void dequant_panel(Fmt fmt, int isa, const Problem& pb, int64_t p, float* dst) {
#if defined(PAGEDLLM_X86)
  if (isa == ISA_AVX2 || isa == ISA_AVX512) {
    if (fmt == Fmt::Q4) dequant_panel_avx2<Fmt::Q4>(pb, p, dst);
    else if (fmt == Fmt::Q8) dequant_panel_avx2<Fmt::Q8>(pb, p, dst);
    else dequant_panel_avx2<Fmt::F8>(pb, p, dst);
    return;
  }
#endif
  dequant_panel_generic(fmt, pb, p, dst);
}

#if defined(PAGEDLLM_X86)
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void f32_tile_avx512(const float* x, int64_t ldx,
                                                                         const float* w, int64_t K, float* tmp) {
  __m512 c[R];
  for (int i = 0; i < R; ++i) c[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wv = _mm512_loadu_ps(w + k * NR);
    for (int i = 0; i < R; ++i) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k]), wv, c[i]);
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(tmp + i * NR, c[i]);
}
#endif

using F32TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*);
using TileFn = void (*)(const Problem&, int64_t, int64_t, float*);

// Tiles for 1..MR rows of one ISA and format; index rows - 1.
struct TileSet {
  int mr;
  TileFn fns[8];
};

#if defined(PAGEDLLM_X86)
const TileSet kQ8Avx2 = {6, {q8_tile_avx2<1>, q8_tile_avx2<2>, q8_tile_avx2<3>, q8_tile_avx2<4>, q8_tile_avx2<5>,
                             q8_tile_avx2<6>}};
const TileSet kQ4Avx2 = {6, {q4_tile_avx2<1>, q4_tile_avx2<2>, q4_tile_avx2<3>, q4_tile_avx2<4>, q4_tile_avx2<5>,
                             q4_tile_avx2<6>}};
const TileSet kF8Avx2 = {6, {f8_tile_avx2<1>, f8_tile_avx2<2>, f8_tile_avx2<3>, f8_tile_avx2<4>, f8_tile_avx2<5>,
                             f8_tile_avx2<6>}};
const TileSet kQ8Avx512 = {8, {q8_tile_avx512<1>, q8_tile_avx512<2>, q8_tile_avx512<3>, q8_tile_avx512<4>,
                               q8_tile_avx512<5>, q8_tile_avx512<6>, q8_tile_avx512<7>, q8_tile_avx512<8>}};
const TileSet kQ4Avx512 = {8, {q4_tile_avx512<1>, q4_tile_avx512<2>, q4_tile_avx512<3>, q4_tile_avx512<4>,
                               q4_tile_avx512<5>, q4_tile_avx512<6>, q4_tile_avx512<7>, q4_tile_avx512<8>}};
const TileSet kF8Avx512 = {8, {f8_tile_avx512<1>, f8_tile_avx512<2>, f8_tile_avx512<3>, f8_tile_avx512<4>,
                               f8_tile_avx512<5>, f8_tile_avx512<6>, f8_tile_avx512<7>, f8_tile_avx512<8>}};
const F32TileFn kF32Avx512[8] = {f32_tile_avx512<1>, f32_tile_avx512<2>, f32_tile_avx512<3>, f32_tile_avx512<4>,
                                 f32_tile_avx512<5>, f32_tile_avx512<6>, f32_tile_avx512<7>, f32_tile_avx512<8>};
#endif

const TileSet* tiles_for(Fmt fmt, int isa) {
#if defined(PAGEDLLM_X86)
  if (isa == ISA_AVX2) return fmt == Fmt::Q4 ? &kQ4Avx2 : fmt == Fmt::Q8 ? &kQ8Avx2 : &kF8Avx2;
  if (isa == ISA_AVX512) return fmt == Fmt::Q4 ? &kQ4Avx512 : fmt == Fmt::Q8 ? &kQ8Avx512 : &kF8Avx512;
#endif
  return nullptr;
}

// The tile's rows -> y (+ bias), only the panel's valid columns.
inline void store_tile(const float* tmp, int rows, float* y, int64_t ldy, const float* bias, int64_t cols) {
  for (int i = 0; i < rows; ++i) {
    float* yr = y + i * ldy;
    const float* t = tmp + i * NR;
    if (bias != nullptr) {
      for (int64_t j = 0; j < cols; ++j) yr[j] = t[j] + bias[j];
    } else {
      std::memcpy(yr, t, sizeof(float) * cols);
    }
  }
}

// Few rows: the format's own tiles widen the weights in registers (weight-bound decode).
void few_rows(Fmt fmt, const Problem& pb, const TileSet* tiles, int64_t M, int64_t N, const float* bias, float* y,
              int64_t ldy, int64_t p0, int64_t p1) {
  float tmp[8 * NR];
  const int mr = tiles != nullptr ? tiles->mr : 8;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    for (int64_t m = 0; m < M; m += mr) {
      const int rows = static_cast<int>(std::min<int64_t>(mr, M - m));
      if (tiles != nullptr) tiles->fns[rows - 1](pb, p, m, tmp);
      else if (fmt == Fmt::Q4) q4_tile_generic(pb, p, m, rows, tmp);
      else if (fmt == Fmt::Q8) q8_tile_generic(pb, p, m, rows, tmp);
      else f8_tile_generic(pb, p, m, rows, tmp);
      store_tile(tmp, rows, y + m * ldy + n0, ldy, bias != nullptr ? bias + n0 : nullptr, cols);
    }
  }
}

// Many rows, AVX-512: dequantized panel x 8-row zmm tiles reading x in place (faster than the fp32 panel
// kernel's 256-bit tiles on the AVX-512 machines measured). Row blocks whose x rows fit in about half of L2
// stay there across this thread's panels; each block dequantizes the panels again.
void many_rows_avx512(Fmt fmt, int isa, const Problem& pb, int64_t M, int64_t N, const float* bias, float* y, int64_t ldy,
                      int64_t p0, int64_t p1) {
#if defined(PAGEDLLM_X86)
  float tmp[8 * NR];
  thread_local std::vector<float> wbuf;
  wbuf.resize(static_cast<size_t>(pb.K * NR));
  const int64_t mblock = std::max<int64_t>(64, (256 * 1024) / (4 * pb.K)) / 8 * 8;
  for (int64_t mb = 0; mb < M; mb += mblock) {
    const int64_t me = std::min(M, mb + mblock);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
      dequant_panel(fmt, isa, pb, p, wbuf.data());
      for (int64_t m = mb; m < me; m += 8) {
        const int rows = static_cast<int>(std::min<int64_t>(8, me - m));
        kF32Avx512[rows - 1](pb.x + m * pb.ldx, pb.ldx, wbuf.data(), pb.K, tmp);
        store_tile(tmp, rows, y + m * ldy + n0, ldy, bias != nullptr ? bias + n0 : nullptr, cols);
      }
    }
  }
#endif
}

// Many rows elsewhere: dequantized panel x the fp32 panel kernel (packed_gemm.cpp) on x packed once per call.
void many_rows_packed(Fmt fmt, int isa, const Problem& pb, const float* xt, int64_t M, int64_t N, const float* bias,
                      float* y, int64_t ldy, int64_t p0, int64_t p1) {
  thread_local std::vector<float> wbuf;
  wbuf.resize(static_cast<size_t>(pb.K * NR));
  const int64_t kc = packed_gemm_k_chunk(pb.K);
  const int64_t mblock = packed_gemm_row_block(pb.K);
  for (int64_t mb = 0; mb < M; mb += mblock) {
    const int64_t rows = std::min(mblock, M - mb);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
      dequant_panel(fmt, isa, pb, p, wbuf.data());
      panel_rows_packed_x(xt + mb * pb.K, rows, wbuf.data(), pb.K, kc, cols, bias != nullptr ? bias + n0 : nullptr,
                          y + mb * ldy + n0, ldy);
    }
  }
}

torch::Tensor quant_gemm(Fmt fmt, const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                         const std::optional<torch::Tensor>& mins, int64_t group, int64_t out_features,
                         const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                         int64_t isa_request) {
  const bool q4 = fmt == Fmt::Q4;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K > 0, "x has no columns");
  TORCH_CHECK(group > 0 && K % group == 0 && (!q4 || group % 2 == 0),
              "group ", group, " must divide K = ", K, q4 ? " and be even" : "");
  const int64_t P = (N + NR - 1) / NR, G = K / group;
  TORCH_CHECK(N > 0, "out_features must be positive");
  const int64_t rows_per_panel = q4 ? K / 2 : K;
  const auto qtype = fmt == Fmt::Q8 ? torch::kInt8 : torch::kUInt8;
  const char* layout = q4 ? "uint8 [P, K/2, 16]" : fmt == Fmt::Q8 ? "int8 [P, K, 16]" : "uint8 [P, K, 16]";
  TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 3 && qweight.size(0) == P &&
              qweight.size(1) == rows_per_panel && qweight.size(2) == NR && qweight.scalar_type() == qtype,
              "qweight must be contiguous ", layout, " with P = ", P, ", K = ", K, "; got ", qweight.sizes());
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == P * G * NR,
              "scales must be contiguous float32 [P, K/group, 16]");
  if (q4) {
    TORCH_CHECK(mins.has_value() && mins->is_contiguous() && mins->scalar_type() == torch::kFloat32 &&
                mins->numel() == P * G * NR, "mins must be contiguous float32 [P, K/group, 16]");
  }
  const torch::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  torch::Tensor bc;
  const float* b = gemm_bias(bias, N, bc);
  torch::Tensor y = gemm_output(out, M, N, x.options());
  if (M == 0) return y;
  const int isa = resolve_isa(isa_request);
  const bool dequant = M >= DEQUANT_MIN_ROWS;
  const bool packed_x = dequant && isa != ISA_AVX512;
  torch::Tensor xsum, xt;
  if (q4 && !dequant) xsum = xc.reshape({M, G, group}).sum(-1).contiguous();
  const int64_t ldx = xc.stride(0);
  const float* xp = xc.data_ptr<float>();
  if (packed_x) {  // x in the fp32 kernel's k-major row tiles, once for all threads
    const int64_t tiles = (M + PACKED_MR - 1) / PACKED_MR;
    xt = torch::empty({tiles * PACKED_MR * K}, x.options());
    float* xtp = xt.data_ptr<float>();
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      const int64_t m0 = t0 * PACKED_MR, m1 = std::min(M, t1 * PACKED_MR);
      pack_x_tiles(xp + m0 * ldx, ldx, m1 - m0, K, xtp + m0 * K);
    });
  }
  Problem pb{xp, ldx, static_cast<const uint8_t*>(qweight.data_ptr()), rows_per_panel * NR,
             scales.data_ptr<float>(), q4 ? mins->data_ptr<float>() : nullptr,
             xsum.defined() ? xsum.data_ptr<float>() : nullptr, K, G, group};
  const TileSet* tiles = tiles_for(fmt, isa);
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);
  // Panels per thread: at least ~64k multiply-adds (widening the weights makes a panel dearer than fp32's).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, M * K * NR));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    if (!dequant) few_rows(fmt, pb, tiles, M, N, b, yp, ldy, p0, p1);
    else if (packed_x) many_rows_packed(fmt, isa, pb, xt.data_ptr<float>(), M, N, b, yp, ldy, p0, p1);
    else many_rows_avx512(fmt, isa, pb, M, N, b, yp, ldy, p0, p1);
  });
  return y;
}

}  // namespace

torch::Tensor q8_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      int64_t group, int64_t out_features, const std::optional<torch::Tensor>& bias,
                      const std::optional<torch::Tensor>& out, int64_t isa) {
  return quant_gemm(Fmt::Q8, x, qweight, scales, std::nullopt, group, out_features, bias, out, isa);
}

torch::Tensor q4_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      const torch::Tensor& mins, int64_t group, int64_t out_features,
                      const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                      int64_t isa) {
  return quant_gemm(Fmt::Q4, x, qweight, scales, mins, group, out_features, bias, out, isa);
}

torch::Tensor f8_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      int64_t group, int64_t out_features, const std::optional<torch::Tensor>& bias,
                      const std::optional<torch::Tensor>& out, int64_t isa) {
  return quant_gemm(Fmt::F8, x, qweight, scales, std::nullopt, group, out_features, bias, out, isa);
}

std::vector<int64_t> supported_isas() {
  std::vector<int64_t> isas{ISA_GENERIC};
  if (cpu_has_avx2()) isas.push_back(ISA_AVX2);
  if (cpu_has_avx512()) isas.push_back(ISA_AVX512);
  return isas;
}
