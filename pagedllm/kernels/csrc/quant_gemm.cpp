// Weight-only quantized matmuls: y[M, N] = x[M, K] @ dequant(W)^T (+ bias), x and y float32.
//
// Weights are repacked once at load time into panels of 16 output columns (like packed_gemm.cpp) so the
// inner loop reads one contiguous stream per panel and widens 16 weights per k into vector lanes:
//   q8: int8 [P, K, 16], w = scale[g] * q                        (int8 per channel, GGUF Q8_0, 8-bit GPTQ)
//   q4: uint8 [P, K/2, 16] (byte j of k pair t: low nibble k = 2t, high nibble k = 2t + 1),
//       w = scale[g] * q + min[g]                                (int4, GGUF Q4_0/Q4_1, 4-bit GPTQ/AWQ)
// with scale/min float32 [P, K/group, 16]. A group's products are summed in float, then scaled once; the
// q4 minimum contributes min * sum(x over the group), from a per-call table of group sums of x. From
// DEQUANT_MIN_ROWS rows on, each panel is instead dequantized once per call and multiplied in float.
//
// ISA dispatch is at run time, per call (isa: 0 = best available, 1 = AVX2+FMA, 2 = AVX-512F/BW/VL,
// 3 = portable C++), so one build serves both CPU kinds and tests can force every path on one machine.
// The x86 paths are compiled with function-level target attributes, not with the build's -march.
#include "gemm_args.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define PAGEDLLM_X86 1
#endif

namespace {

constexpr int64_t NR = 16;  // output columns per panel
constexpr int ISA_AUTO = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_GENERIC = 3;

bool cpu_has_avx2() {
#if defined(PAGEDLLM_X86)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(PAGEDLLM_X86)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

int resolve_isa(int64_t isa) {
  if (isa == ISA_AUTO) return cpu_has_avx512() ? ISA_AVX512 : cpu_has_avx2() ? ISA_AVX2 : ISA_GENERIC;
  TORCH_CHECK(isa == ISA_AVX2 || isa == ISA_AVX512 || isa == ISA_GENERIC, "isa must be 0..3, got ", isa);
  TORCH_CHECK(isa != ISA_AVX2 || cpu_has_avx2(), "this CPU has no AVX2+FMA");
  TORCH_CHECK(isa != ISA_AVX512 || cpu_has_avx512(), "this CPU has no AVX-512F/BW/VL");
  return static_cast<int>(isa);
}

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
#endif

// ---------------------------------------------------------------- many rows: dequantize, then fp32 tiles
// Past one register tile of rows, widening every weight once per row tile costs more than the multiply-adds;
// instead each panel is dequantized once per call into a float buffer [K, 16] and all rows multiply it.
constexpr int64_t DEQUANT_MIN_ROWS = 9;  // one 8-row AVX-512 tile still reads the weights directly

void dequant_panel(bool q4, const Problem& pb, int64_t p, float* dst) {
  const float* sc = pb.scales + p * pb.G * NR;
  if (q4) {
    const uint8_t* panel = pb.w + p * pb.panel_bytes;
    const float* mn = pb.mins + p * pb.G * NR;
    for (int64_t k = 0; k < pb.K; ++k) {
      const uint8_t* b = panel + (k / 2) * NR;
      const int shift = (k & 1) ? 4 : 0;
      const float* s = sc + (k / pb.group) * NR;
      const float* m = mn + (k / pb.group) * NR;
      for (int j = 0; j < NR; ++j) dst[k * NR + j] = static_cast<float>((b[j] >> shift) & 15) * s[j] + m[j];
    }
  } else {
    const int8_t* panel = reinterpret_cast<const int8_t*>(pb.w + p * pb.panel_bytes);
    for (int64_t k = 0; k < pb.K; ++k) {
      const float* s = sc + (k / pb.group) * NR;
      for (int j = 0; j < NR; ++j) dst[k * NR + j] = static_cast<float>(panel[k * NR + j]) * s[j];
    }
  }
}

void f32_tile_generic(const float* x, int64_t ldx, const float* w, int64_t K, int rows, float* tmp) {
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < NR; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[i * ldx + k] * w[k * NR + j];
      tmp[i * NR + j] = acc;
    }
}

#if defined(PAGEDLLM_X86)
template <int R>
__attribute__((target("avx2,fma"))) void f32_tile_avx2(const float* x, int64_t ldx, const float* w, int64_t K,
                                                       float* tmp) {
  __m256 c[R][2];
  for (int i = 0; i < R; ++i) c[i][0] = c[i][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * NR), w1 = _mm256_loadu_ps(w + k * NR + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
      c[i][0] = _mm256_fmadd_ps(xv, w0, c[i][0]);
      c[i][1] = _mm256_fmadd_ps(xv, w1, c[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(tmp + i * NR, c[i][0]);
    _mm256_storeu_ps(tmp + i * NR + 8, c[i][1]);
  }
}

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

struct F32TileSet {
  int mr;
  F32TileFn fns[8];
};

#if defined(PAGEDLLM_X86)
const TileSet kQ8Avx2 = {6, {q8_tile_avx2<1>, q8_tile_avx2<2>, q8_tile_avx2<3>, q8_tile_avx2<4>, q8_tile_avx2<5>,
                             q8_tile_avx2<6>}};
const TileSet kQ4Avx2 = {6, {q4_tile_avx2<1>, q4_tile_avx2<2>, q4_tile_avx2<3>, q4_tile_avx2<4>, q4_tile_avx2<5>,
                             q4_tile_avx2<6>}};
const TileSet kQ8Avx512 = {8, {q8_tile_avx512<1>, q8_tile_avx512<2>, q8_tile_avx512<3>, q8_tile_avx512<4>,
                               q8_tile_avx512<5>, q8_tile_avx512<6>, q8_tile_avx512<7>, q8_tile_avx512<8>}};
const TileSet kQ4Avx512 = {8, {q4_tile_avx512<1>, q4_tile_avx512<2>, q4_tile_avx512<3>, q4_tile_avx512<4>,
                               q4_tile_avx512<5>, q4_tile_avx512<6>, q4_tile_avx512<7>, q4_tile_avx512<8>}};
const F32TileSet kF32Avx2 = {6, {f32_tile_avx2<1>, f32_tile_avx2<2>, f32_tile_avx2<3>, f32_tile_avx2<4>,
                                 f32_tile_avx2<5>, f32_tile_avx2<6>}};
const F32TileSet kF32Avx512 = {8, {f32_tile_avx512<1>, f32_tile_avx512<2>, f32_tile_avx512<3>, f32_tile_avx512<4>,
                                   f32_tile_avx512<5>, f32_tile_avx512<6>, f32_tile_avx512<7>, f32_tile_avx512<8>}};
#endif

torch::Tensor quant_gemm(bool q4, const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                         const std::optional<torch::Tensor>& mins, int64_t group, int64_t out_features,
                         const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                         int64_t isa_request) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K > 0, "x has no columns");
  TORCH_CHECK(group > 0 && K % group == 0 && (!q4 || group % 2 == 0),
              "group ", group, " must divide K = ", K, q4 ? " and be even" : "");
  const int64_t P = (N + NR - 1) / NR, G = K / group;
  TORCH_CHECK(N > 0, "out_features must be positive");
  const int64_t rows_per_panel = q4 ? K / 2 : K;
  TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 3 && qweight.size(0) == P &&
              qweight.size(1) == rows_per_panel && qweight.size(2) == NR &&
              qweight.scalar_type() == (q4 ? torch::kUInt8 : torch::kInt8),
              "qweight must be contiguous ", q4 ? "uint8 [P, K/2, 16]" : "int8 [P, K, 16]", " with P = ", P,
              ", K = ", K, "; got ", qweight.sizes());
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == P * G * NR,
              "scales must be contiguous float32 [P, K/group, 16]");
  torch::Tensor xsum;
  if (q4) {
    TORCH_CHECK(mins.has_value() && mins->is_contiguous() && mins->scalar_type() == torch::kFloat32 &&
                mins->numel() == P * G * NR, "mins must be contiguous float32 [P, K/group, 16]");
  }
  const torch::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  torch::Tensor bc;
  const float* b = gemm_bias(bias, N, bc);
  torch::Tensor y = gemm_output(out, M, N, x.options());
  if (M == 0) return y;
  const bool dequant = M >= DEQUANT_MIN_ROWS;
  if (q4 && !dequant) xsum = xc.reshape({M, G, group}).sum(-1).contiguous();

  const int isa = resolve_isa(isa_request);
  Problem pb{xc.data_ptr<float>(), xc.stride(0), static_cast<const uint8_t*>(qweight.data_ptr()),
             rows_per_panel * NR, scales.data_ptr<float>(), q4 ? mins->data_ptr<float>() : nullptr,
             xsum.defined() ? xsum.data_ptr<float>() : nullptr, K, G, group};
  const TileSet* tiles = nullptr;
  const F32TileSet* f32_tiles = nullptr;
#if defined(PAGEDLLM_X86)
  if (isa == ISA_AVX2) tiles = q4 ? &kQ4Avx2 : &kQ8Avx2, f32_tiles = &kF32Avx2;
  if (isa == ISA_AVX512) tiles = q4 ? &kQ4Avx512 : &kQ8Avx512, f32_tiles = &kF32Avx512;
#endif
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);
  // Panels per thread: at least ~64k multiply-adds (widening the weights makes a panel dearer than fp32's).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, M * K * NR));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    float tmp[8 * NR];
    thread_local std::vector<float> wbuf;
    if (dequant) wbuf.resize(static_cast<size_t>(K * NR));
    const int mr = tiles != nullptr ? tiles->mr : 8;
    // Row blocks whose x rows fit in about half of L2 stay there across this thread's panels; each block
    // dequantizes the panels again (cheap next to ~100 rows of multiply-adds).
    const int64_t mblock = dequant ? std::max<int64_t>(64, (256 * 1024) / (4 * K)) / mr * mr : M;
    for (int64_t mb = 0; mb < M; mb += mblock)
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
      if (dequant) dequant_panel(q4, pb, p, wbuf.data());
      for (int64_t m = mb; m < std::min(M, mb + mblock); m += mr) {
        const int rows = static_cast<int>(std::min<int64_t>(mr, std::min(M, mb + mblock) - m));
        const float* xm = pb.x + m * pb.ldx;
        if (dequant && f32_tiles != nullptr) f32_tiles->fns[rows - 1](xm, pb.ldx, wbuf.data(), K, tmp);
        else if (dequant) f32_tile_generic(xm, pb.ldx, wbuf.data(), K, rows, tmp);
        else if (tiles != nullptr) tiles->fns[rows - 1](pb, p, m, tmp);
        else if (q4) q4_tile_generic(pb, p, m, rows, tmp);
        else q8_tile_generic(pb, p, m, rows, tmp);
        for (int i = 0; i < rows; ++i) {
          float* yr = yp + (m + i) * ldy + n0;
          const float* t = tmp + i * NR;
          if (b != nullptr) {
            for (int64_t j = 0; j < cols; ++j) yr[j] = t[j] + b[n0 + j];
          } else {
            std::memcpy(yr, t, sizeof(float) * cols);
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

torch::Tensor q8_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      int64_t group, int64_t out_features, const std::optional<torch::Tensor>& bias,
                      const std::optional<torch::Tensor>& out, int64_t isa) {
  return quant_gemm(false, x, qweight, scales, std::nullopt, group, out_features, bias, out, isa);
}

torch::Tensor q4_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      const torch::Tensor& mins, int64_t group, int64_t out_features,
                      const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                      int64_t isa) {
  return quant_gemm(true, x, qweight, scales, mins, group, out_features, bias, out, isa);
}

std::vector<int64_t> supported_isas() {
  std::vector<int64_t> isas{ISA_GENERIC};
  if (cpu_has_avx2()) isas.push_back(ISA_AVX2);
  if (cpu_has_avx512()) isas.push_back(ISA_AVX512);
  return isas;
}
