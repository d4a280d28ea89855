// 4-bit weights times int8 activations: y[M, N] = x[M, K] @ (scale * q + min)^T (+ bias), x float32.
//
// Why: multiplying 4-bit weights in float (quant_gemm.cpp's q4 tiles) spends ~10 instructions widening and
// converting every 32 weights, so one decode stream is compute-bound on two cores long before memory is.
// Here the products are summed in int32 by byte dot products: AVX-512 VNNI's vpdpbusd (64 u8 x s8
// multiply-adds per instruction) or AVX2's vpmaddubsw + vpmaddwd.
//
// x is split per (row, weight group) into two int8 terms (dot_gemm.h). Per group g and column n:
//   y[m, n] += scale[n, g] * (dx * sum_k q x1 + dx / 254 * sum_k q x2) + min[n, g] * sum_k x[m, k]
// with the group sum of x exact (float).
//
// Weight layout "dot8", uint8 [P, K/8, 64] (P panels of 16 output columns, one 64-byte block per 8 k):
// byte 4 * j + t of block b holds q[k = 8b + t, column j] in its low nibble and q[8b + 4 + t, j] in its high
// nibble, so masking the low (high) nibbles of a block gives the 4 consecutive k of each column in one
// 32-bit lane: exactly what the byte dot products consume against 4 broadcast bytes of x.
//
// scales and mins are float16 [P, G, 16] (GGUF's Q4_0/Q4_1 store them so, exactly): a decode stream is bound by
// memory bandwidth, and fp32 ones were a third of a 4-bit layer's bytes (now a fifth, as in llama.cpp's Q4_1).
//
// ISA dispatch at run time per call (isa as in cpu_features.h: 0 = best, 1 = AVX2, 2 = AVX-512, 3 = portable);
// AVX-512 runs the VNNI tiles where the CPU has VNNI and the AVX2 tiles otherwise.
#include "amx_dot.h"
#include "cpu_features.h"
#include "dot_gemm.h"
#include "gemm_args.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define PAGEDLLM_X86 1
#endif

namespace {

using dot_gemm::Activations;
using dot_gemm::MR;
using dot_gemm::NR;
using dot_gemm::RESIDUAL_STEPS;
constexpr int64_t BLOCK_K = 8;     // k per 64-byte block
constexpr int64_t BLOCK_BYTES = 64;
// Software prefetch distances. A decode step's matmuls are small (0.2-1.1 MB each) and stream from memory,
// so the hardware prefetcher, restarting at every call, leaves one stream per core latency-bound: 96 blocks
// (6 KiB) ahead took the default model's 120 decode matmuls from 2.1 to 1.65 ms (AVX-512, 2 cores).
constexpr int64_t PREFETCH_BLOCKS = 96;
constexpr int64_t PREFETCH_GROUPS = 16;  // scales and mins, 32 bytes each per group

enum class Path { kGeneric, kAvx2, kVnni512 };

// AVX-512 without VNNI (and an explicit AVX2 request) runs the AVX2 tiles.
Path resolve_path(int64_t isa_request) {
  const int isa = resolve_isa(isa_request);
  if (isa == ISA_GENERIC) return Path::kGeneric;
  return isa == ISA_AVX512 && cpu_has_vnni512() ? Path::kVnni512 : Path::kAvx2;
}

struct Problem {
  const uint8_t* w;     // panel p at w + p * panel_bytes
  int64_t panel_bytes;
  const uint16_t* scales;  // float16 bits [P, G, 16]
  const uint16_t* mins;    // float16 bits [P, G, 16]
  const Activations* a;
  int64_t K, G, group;
};

void tile_generic(const Problem& pb, int64_t p, int64_t m0, int rows, float* acc) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  std::fill(acc, acc + rows * NR, 0.f);
  const int64_t blocks_per_group = pb.group / BLOCK_K;
  for (int64_t g = 0; g < pb.G; ++g) {
    float s[NR], mn[NR];
    for (int j = 0; j < NR; ++j) {
      s[j] = c10::detail::fp16_ieee_to_fp32_value(pb.scales[(p * pb.G + g) * NR + j]);
      mn[j] = c10::detail::fp16_ieee_to_fp32_value(pb.mins[(p * pb.G + g) * NR + j]);
    }
    for (int i = 0; i < rows; ++i) {
      int32_t d1[NR] = {}, d2[NR] = {};
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const uint8_t* blk = panel + b * BLOCK_BYTES;
        const int8_t* x1 = pb.a->x1.data() + (m0 + i) * pb.K + b * BLOCK_K;
        const int8_t* x2 = pb.a->x2.data() + (m0 + i) * pb.K + b * BLOCK_K;
        for (int j = 0; j < NR; ++j)
          for (int t = 0; t < 4; ++t) {
            const int lo = blk[4 * j + t] & 15, hi = blk[4 * j + t] >> 4;
            d1[j] += lo * x1[t] + hi * x1[4 + t];
            d2[j] += lo * x2[t] + hi * x2[4 + t];
          }
      }
      const int64_t o = (m0 + i) * pb.G + g;
      const float dx = pb.a->d[o], dx2 = dx / RESIDUAL_STEPS, xs = pb.a->s[o];
      for (int j = 0; j < NR; ++j)
        acc[i * NR + j] += s[j] * (static_cast<float>(d1[j]) * dx + static_cast<float>(d2[j]) * dx2) + mn[j] * xs;
    }
  }
}

#if defined(PAGEDLLM_X86)
// The 8 int8 activations of row m at block b, as the 32-bit words the byte dot products broadcast: x1 and x2
// (the two terms), k 8b..8b+3 (the weights' low nibbles) and 8b+4..8b+7 (the high nibbles).
struct XWords {
  int32_t x1_lo, x1_hi, x2_lo, x2_hi;
};
inline XWords x_words(const Problem& pb, int64_t m, int64_t b) {
  const int64_t off = m * pb.K + b * BLOCK_K;
  XWords w;
  std::memcpy(&w.x1_lo, pb.a->x1.data() + off, 4);
  std::memcpy(&w.x1_hi, pb.a->x1.data() + off + 4, 4);
  std::memcpy(&w.x2_lo, pb.a->x2.data() + off, 4);
  std::memcpy(&w.x2_hi, pb.a->x2.data() + off + 4, 4);
  return w;
}

// Prefetches past the end of an array are harmless: prefetch instructions never fault.
inline void prefetch_scales(const Problem& pb, int64_t p, int64_t g) {
  const int64_t o = (p * pb.G + g + PREFETCH_GROUPS) * NR;
  _mm_prefetch(reinterpret_cast<const char*>(pb.scales + o), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(pb.mins + o), _MM_HINT_T0);
}

// AVX2: 16 columns = 2 registers, run as two passes of 8 columns over the panel's group. With both halves in one
// pass, a 2-row tile's 8 int32 sums, 4 unpacked weight registers and the broadcasts outgrow the 16 registers and
// the compiler kept the sums on the stack (a store-to-load chain every block); one half at a time needs 2R sums
// and 2 weight registers, so up to 4 rows fit. The second pass re-reads the group's x words (L1 loads) only.
//
// The multiply port bounds this loop on AVX2 (vpmaddubsw and vpmaddwd share it). A block's u8 x s8 products land
// in int16 lanes (2 * 15 * 127 = 3810 at most, low and high nibbles together 7620), so a group of up to
// SHORT_GROUP_BLOCKS = 4 blocks (32 k: GGUF's Q4_0/Q4_1 group) sums in int16 exactly and is widened by one
// vpmaddwd (kShort): 9 multiplies per row and block instead of 12. Longer groups widen every block. The sums
// are exact integers either way, so both give the same result.
constexpr int64_t SHORT_GROUP_BLOCKS = 4;

template <int R, bool kShort>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const Problem& pb, int64_t p, int64_t m0, float* acc) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const int8_t* x1 = pb.a->x1.data();
  const int8_t* x2 = pb.a->x2.data();
  const float* xd = pb.a->d.data();
  const float* xs = pb.a->s.data();
  const int64_t K = pb.K, G = pb.G;
  const __m256i mask = _mm256_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < R * static_cast<int>(NR); ++i) acc[i] = 0.f;
  const int64_t blocks_per_group = pb.group / BLOCK_K;
  for (int64_t g = 0; g < G; ++g) {
    prefetch_scales(pb, p, g);
    const int64_t o = (p * G + g) * NR;
    for (int h = 0; h < 2; ++h) {
      __m256i c1[R], c2[R];  // int16 sums of the group's blocks (kShort), else int32 sums
      for (int i = 0; i < R; ++i) c1[i] = c2[i] = _mm256_setzero_si256();
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const uint8_t* blk = panel + b * BLOCK_BYTES;
        if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BLOCKS * BLOCK_BYTES), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * h));  // columns 8h..8h+7
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int i = 0; i < R; ++i) {
          const int64_t off = (m0 + i) * K + b * BLOCK_K;
          int32_t w[4];
          std::memcpy(&w[0], x1 + off, 4);
          std::memcpy(&w[1], x1 + off + 4, 4);
          std::memcpy(&w[2], x2 + off, 4);
          std::memcpy(&w[3], x2 + off + 4, 4);
          const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(w[0])),
                                              _mm256_maddubs_epi16(hi, _mm256_set1_epi32(w[1])));
          const __m256i p2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(w[2])),
                                              _mm256_maddubs_epi16(hi, _mm256_set1_epi32(w[3])));
          if constexpr (kShort) {
            c1[i] = _mm256_add_epi16(c1[i], p1);
            c2[i] = _mm256_add_epi16(c2[i], p2);
          } else {
            c1[i] = _mm256_add_epi32(c1[i], _mm256_madd_epi16(p1, ones));
            c2[i] = _mm256_add_epi32(c2[i], _mm256_madd_epi16(p2, ones));
          }
        }
      }
      if constexpr (kShort) {
        for (int i = 0; i < R; ++i) {
          c1[i] = _mm256_madd_epi16(c1[i], ones);
          c2[i] = _mm256_madd_epi16(c2[i], ones);
        }
      }
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb.scales + o + 8 * h)));
      const __m256 n = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pb.mins + o + 8 * h)));
      for (int i = 0; i < R; ++i) {
        const int64_t ro = (m0 + i) * G + g;
        const float dx = xd[ro];
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(c1[i]), _mm256_set1_ps(dx));
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c2[i]), _mm256_set1_ps(dx / RESIDUAL_STEPS), t);
        float* a = acc + i * NR + 8 * h;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(t, s, _mm256_fmadd_ps(n, _mm256_set1_ps(xs[ro]), _mm256_loadu_ps(a))));
      }
    }
  }
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void tile_vnni512(const Problem& pb, int64_t p,
                                                                                 int64_t m0, float* acc) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const __m512i mask = _mm512_set1_epi8(15);
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  const int64_t blocks_per_group = pb.group / BLOCK_K;
  for (int64_t g = 0; g < pb.G; ++g) {
    // Low and high nibbles sum into separate registers: vpdpbusd's latency (~5 cycles) would otherwise chain
    // every dot product of a row, which bounds one decode row (M = 1) long before throughput does.
    __m512i c1[R], c2[R], h1[R], h2[R];
    for (int i = 0; i < R; ++i) c1[i] = c2[i] = h1[i] = h2[i] = _mm512_setzero_si512();
    prefetch_scales(pb, p, g);
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (b + PREFETCH_BLOCKS) * BLOCK_BYTES), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(panel + b * BLOCK_BYTES);
      const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      for (int i = 0; i < R; ++i) {
        const XWords x = x_words(pb, m0 + i, b);
        c1[i] = _mm512_dpbusd_epi32(c1[i], lo, _mm512_set1_epi32(x.x1_lo));
        h1[i] = _mm512_dpbusd_epi32(h1[i], hi, _mm512_set1_epi32(x.x1_hi));
        c2[i] = _mm512_dpbusd_epi32(c2[i], lo, _mm512_set1_epi32(x.x2_lo));
        h2[i] = _mm512_dpbusd_epi32(h2[i], hi, _mm512_set1_epi32(x.x2_hi));
      }
    }
    const int64_t o = (p * pb.G + g) * NR;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb.scales + o)));
    const __m512 n = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb.mins + o)));
    for (int i = 0; i < R; ++i) {
      const int64_t ro = (m0 + i) * pb.G + g;
      f[i] = dot_gemm::add_scaled_sums(_mm512_fmadd_ps(n, _mm512_set1_ps(pb.a->s[ro]), f[i]),
                                       _mm512_add_epi32(c1[i], h1[i]), _mm512_add_epi32(c2[i], h2[i]), pb.a->d[ro], s);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(acc + i * NR, f[i]);
}

using TileFn = void (*)(const Problem&, int64_t, int64_t, float*);
// Index rows - 1 of a tile of at most MR rows.
const TileFn kAvx2Tiles[MR] = {tile_avx2<1, false>, tile_avx2<2, false>, tile_avx2<3, false>, tile_avx2<4, false>};
const TileFn kAvx2ShortTiles[MR] = {tile_avx2<1, true>, tile_avx2<2, true>, tile_avx2<3, true>, tile_avx2<4, true>};
const TileFn kVnni512Tiles[MR] = {tile_vnni512<1>, tile_vnni512<2>, tile_vnni512<3>, tile_vnni512<4>};
#endif

void run_tile(Path path, const Problem& pb, int64_t p, int64_t m0, int rows, float* acc) {
#if defined(PAGEDLLM_X86)
  if (path == Path::kVnni512) return kVnni512Tiles[rows - 1](pb, p, m0, acc);
  if (path == Path::kAvx2)
    return (pb.group <= SHORT_GROUP_BLOCKS * BLOCK_K ? kAvx2ShortTiles : kAvx2Tiles)[rows - 1](pb, p, m0, acc);
#endif
  tile_generic(pb, p, m0, rows, acc);
}

}  // namespace

torch::Tensor q4_dot_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                          const torch::Tensor& mins, int64_t group, int64_t out_features,
                          const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                          int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K > 0 && N > 0, "empty matmul");
  TORCH_CHECK(group > 0 && group % BLOCK_K == 0 && K % group == 0, "group ", group,
              " must be a multiple of 8 that divides K = ", K);
  const int64_t P = (N + NR - 1) / NR, G = K / group;
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == torch::kUInt8 && qweight.dim() == 3 &&
              qweight.size(0) == P && qweight.size(1) == K / BLOCK_K && qweight.size(2) == BLOCK_BYTES,
              "qweight must be contiguous uint8 [P, K/8, 64] with P = ", P, ", K = ", K, "; got ", qweight.sizes());
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kHalf && scales.numel() == P * G * NR,
              "scales must be contiguous float16 [P, K/group, 16]");
  TORCH_CHECK(mins.is_contiguous() && mins.scalar_type() == torch::kHalf && mins.numel() == P * G * NR,
              "mins must be contiguous float16 [P, K/group, 16]");
  const bool amx = isa == ISA_AMX;
  TORCH_CHECK(!amx || amx_dot::supported(), "q4_dot_gemm: isa 4 (AMX) on a CPU without AMX tiles");
  const Path path = amx ? Path::kVnni512 : resolve_path(isa);  // AMX splits x as the AVX-512 tiles do
  const torch::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  torch::Tensor bc;
  const float* b = gemm_bias(bias, N, bc);
  torch::Tensor y = gemm_output(out, M, N, x.options());
  if (M == 0) return y;

  Activations act;
  dot_gemm::quantize_activations(xc.data_ptr<float>(), xc.stride(0), M, K, group, act,
                                path == Path::kVnni512 ? dot_gemm::Split::kAvx512
                                : path == Path::kAvx2  ? dot_gemm::Split::kAvx2
                                                       : dot_gemm::Split::kScalar);
  const Problem pb{qweight.data_ptr<uint8_t>(), (K / BLOCK_K) * BLOCK_BYTES,
                   reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                   reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), &act, K, G, group};
  if (amx) {
    amx_dot::gemm(act, M, N, K, group, {pb.w, pb.panel_bytes, true, pb.scales, true, pb.mins}, b, y.data_ptr<float>(),
                  y.stride(0));
    return y;
  }
  dot_gemm::for_each_tile(M, N, K, b, y.data_ptr<float>(), y.stride(0),
                          [&](int64_t p, int64_t m, int rows, float* acc) { run_tile(path, pb, p, m, rows, acc); });
  return y;
}
