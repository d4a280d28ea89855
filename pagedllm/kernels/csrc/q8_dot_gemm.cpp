// 8-bit weights times int8 activations: y[M, N] = x[M, K] @ (scale * q)^T (+ bias), x float32, q int8.
//
// Why: the weight-only q8 tiles (quant_gemm.cpp) widen every 16 weights to float (two conversions and an FMA), so
// the default model's tied LM head (49152 x 576, GGUF Q8_0: 30 MB, a third of a decode step's bytes) ran at
// about half the memory bandwidth inside a decode step on an Intel Xeon (1.65 ms). Here the products are summed in
// int32 by AVX-512 VNNI's vpdpbusd (64 multiply-adds per instruction), x split into two int8 terms per group as in
// q4_dot_gemm.cpp (dot_gemm.h), so the loop is bound by the weights' bytes.
//
// Weight layout "dot4", uint8 [P, K/4, 64] (P panels of 16 output columns, one 64-byte block per 4 k): byte
// 4 * j + t of block b holds q[k = 4b + t, column j] + 128. vpdpbusd multiplies unsigned bytes (the weights, offset
// into 0..255) by signed ones (x): sum_k (q + 128) x1 = sum_k q x1 + 128 * sum_k x1, and the integer sums of x1 and
// x2 over each group are known per row, so the offset comes out exactly. Per group g and column n:
//   y[m, n] += scale[n, g] * (dx * (sum_k u x1 - 128 sum_k x1) + dx / 254 * (sum_k u x2 - 128 sum_k x2))
// scales are float16 or float32 [P, G, 16] (float16 where they are exact, as GGUF's Q8_0 stores them).
//
// Only AVX-512 VNNI runs this fast (isa 0 or 2 on a CPU with VNNI); the portable loop (isa 3) serves tests and
// other CPUs, where the autotuner (kernel_choice.py) keeps the widening kernel.
#include "amx_dot.h"
#include "cpu_features.h"
#include "dot_gemm.h"
#include "gemm_args.h"
#include "kernels.h"

#include <c10/util/Half.h>

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define PAGEDLLM_X86 1
#endif

namespace {

using dot_gemm::Activations;
using dot_gemm::MR;
using dot_gemm::NR;
using dot_gemm::RESIDUAL_STEPS;
constexpr int64_t BLOCK_K = 4;  // k per 64-byte block
constexpr int64_t BLOCK_BYTES = 64;
constexpr int32_t OFFSET = 128;
// 64 blocks (4 KiB) ahead: as in q4_dot_gemm.cpp, the hardware prefetcher alone leaves each core's stream
// latency-bound once the weights come from memory.
constexpr int64_t PREFETCH_BLOCKS = 64;

struct Problem {
  const uint8_t* w;  // panel p at w + p * panel_bytes
  int64_t panel_bytes;
  const void* scales;  // [P, G, 16], float16 bits or float
  bool half_scales;
  const Activations* a;
  int64_t K, G, group;
};

inline float scale_at(const Problem& pb, int64_t i) {
  return pb.half_scales ? c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(pb.scales)[i])
                        : static_cast<const float*>(pb.scales)[i];
}

void tile_generic(const Problem& pb, int64_t p, int64_t m0, int rows, float* acc) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  std::fill(acc, acc + rows * NR, 0.f);
  for (int64_t g = 0; g < pb.G; ++g) {
    for (int i = 0; i < rows; ++i) {
      int32_t d1[NR] = {}, d2[NR] = {};
      for (int64_t k = g * pb.group; k < (g + 1) * pb.group; ++k) {
        const uint8_t* blk = panel + (k / BLOCK_K) * BLOCK_BYTES + k % BLOCK_K;
        const int32_t x1 = pb.a->x1[(m0 + i) * pb.K + k], x2 = pb.a->x2[(m0 + i) * pb.K + k];
        for (int j = 0; j < NR; ++j) {
          d1[j] += blk[4 * j] * x1;
          d2[j] += blk[4 * j] * x2;
        }
      }
      const int64_t o = (m0 + i) * pb.G + g;
      const float dx = pb.a->d[o], dx2 = dx / RESIDUAL_STEPS;
      const int32_t c1 = OFFSET * pb.a->s1[o], c2 = OFFSET * pb.a->s2[o];
      for (int j = 0; j < NR; ++j)
        acc[i * NR + j] += scale_at(pb, (p * pb.G + g) * NR + j) *
                           (static_cast<float>(d1[j] - c1) * dx + static_cast<float>(d2[j] - c2) * dx2);
    }
  }
}

#if defined(PAGEDLLM_X86)
// R rows x 16 columns. Even and odd blocks sum into separate registers: vpdpbusd's latency (~5 cycles) would
// otherwise chain every dot product of a row, which bounds one decode row long before memory does.
template <int R, bool kHalf>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void tile_vnni512(const Problem& pb, int64_t p,
                                                                                 int64_t m0, float* acc) {
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const int8_t* x1 = pb.a->x1.data();
  const int8_t* x2 = pb.a->x2.data();
  const int64_t K = pb.K, blocks_per_group = pb.group / BLOCK_K;
  __m512 f[R];
  for (int i = 0; i < R; ++i) f[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < pb.G; ++g) {
    __m512i a1[R], a2[R], b1[R], b2[R];
    for (int i = 0; i < R; ++i) a1[i] = a2[i] = b1[i] = b2[i] = _mm512_setzero_si512();
    const int64_t bend = (g + 1) * blocks_per_group;
    int64_t b = g * blocks_per_group;
    for (; b + 1 < bend; b += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (b + PREFETCH_BLOCKS) * BLOCK_BYTES), _MM_HINT_T0);
      const __m512i w0 = _mm512_loadu_si512(panel + b * BLOCK_BYTES);
      const __m512i w1 = _mm512_loadu_si512(panel + (b + 1) * BLOCK_BYTES);
      for (int i = 0; i < R; ++i) {
        int32_t x[4];
        const int64_t off = (m0 + i) * K + b * BLOCK_K;
        std::memcpy(&x[0], x1 + off, 4);
        std::memcpy(&x[1], x2 + off, 4);
        std::memcpy(&x[2], x1 + off + 4, 4);
        std::memcpy(&x[3], x2 + off + 4, 4);
        a1[i] = _mm512_dpbusd_epi32(a1[i], w0, _mm512_set1_epi32(x[0]));
        a2[i] = _mm512_dpbusd_epi32(a2[i], w0, _mm512_set1_epi32(x[1]));
        b1[i] = _mm512_dpbusd_epi32(b1[i], w1, _mm512_set1_epi32(x[2]));
        b2[i] = _mm512_dpbusd_epi32(b2[i], w1, _mm512_set1_epi32(x[3]));
      }
    }
    if (b < bend) {  // an odd number of blocks per group
      const __m512i w0 = _mm512_loadu_si512(panel + b * BLOCK_BYTES);
      for (int i = 0; i < R; ++i) {
        int32_t x[2];
        const int64_t off = (m0 + i) * K + b * BLOCK_K;
        std::memcpy(&x[0], x1 + off, 4);
        std::memcpy(&x[1], x2 + off, 4);
        a1[i] = _mm512_dpbusd_epi32(a1[i], w0, _mm512_set1_epi32(x[0]));
        a2[i] = _mm512_dpbusd_epi32(a2[i], w0, _mm512_set1_epi32(x[1]));
      }
    }
    const int64_t o = (p * pb.G + g) * NR;
    __m512 s;
    if constexpr (kHalf) {
      s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(pb.scales) + o)));
    } else {
      s = _mm512_loadu_ps(static_cast<const float*>(pb.scales) + o);
    }
    for (int i = 0; i < R; ++i) {
      const int64_t ro = (m0 + i) * pb.G + g;
      const __m512i d1 = _mm512_sub_epi32(_mm512_add_epi32(a1[i], b1[i]), _mm512_set1_epi32(OFFSET * pb.a->s1[ro]));
      const __m512i d2 = _mm512_sub_epi32(_mm512_add_epi32(a2[i], b2[i]), _mm512_set1_epi32(OFFSET * pb.a->s2[ro]));
      f[i] = dot_gemm::add_scaled_sums(f[i], d1, d2, pb.a->d[ro], s);
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(acc + i * NR, f[i]);
}

using TileFn = void (*)(const Problem&, int64_t, int64_t, float*);
// Index rows - 1 of a tile of at most MR rows.
const TileFn kHalfTiles[MR] = {tile_vnni512<1, true>, tile_vnni512<2, true>, tile_vnni512<3, true>,
                               tile_vnni512<4, true>};
const TileFn kFloatTiles[MR] = {tile_vnni512<1, false>, tile_vnni512<2, false>, tile_vnni512<3, false>,
                                tile_vnni512<4, false>};
#endif

}  // namespace

bool q8_dot_supported() { return cpu_has_vnni512(); }

torch::Tensor q8_dot_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                          int64_t group, int64_t out_features, const std::optional<torch::Tensor>& bias,
                          const std::optional<torch::Tensor>& out, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K > 0 && N > 0, "empty matmul");
  // A group's u8 x s8 sums stay exact in int32 up to 2^31 / (255 * 127) k.
  TORCH_CHECK(group > 0 && group % BLOCK_K == 0 && K % group == 0 && group <= 65536, "group ", group,
              " must be a multiple of 4 (at most 65536) that divides K = ", K);
  const int64_t P = (N + NR - 1) / NR, G = K / group;
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == torch::kUInt8 && qweight.dim() == 3 &&
              qweight.size(0) == P && qweight.size(1) == K / BLOCK_K && qweight.size(2) == BLOCK_BYTES,
              "qweight must be contiguous uint8 [P, K/4, 64] with P = ", P, ", K = ", K, "; got ", qweight.sizes());
  const bool half = scales.scalar_type() == torch::kHalf;
  TORCH_CHECK(scales.is_contiguous() && (half || scales.scalar_type() == torch::kFloat32) &&
              scales.numel() == P * G * NR, "scales must be contiguous float16 or float32 [P, K/group, 16]");
  const bool amx = isa == ISA_AMX;
  TORCH_CHECK(!amx || amx_dot::supported(), "q8_dot_gemm: isa 4 (AMX) on a CPU without AMX tiles");
  const int resolved = amx ? ISA_AVX512 : resolve_isa(isa);  // AMX splits x as the AVX-512 tiles do
  const bool vnni = resolved == ISA_AVX512 && cpu_has_vnni512();
  TORCH_CHECK(vnni || resolved == ISA_GENERIC, "q8_dot_gemm runs on AVX-512 VNNI (isa 0 or 2) or the portable ",
              "path (isa 3); asked for isa ", isa, (cpu_has_vnni512() ? "" : " on a CPU without AVX-512 VNNI"));
  const torch::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  torch::Tensor bc;
  const float* b = gemm_bias(bias, N, bc);
  torch::Tensor y = gemm_output(out, M, N, x.options());
  if (M == 0) return y;

  Activations act;
  dot_gemm::quantize_activations(xc.data_ptr<float>(), xc.stride(0), M, K, group, act,
                                vnni ? dot_gemm::Split::kAvx512 : dot_gemm::Split::kScalar);
  const Problem pb{qweight.data_ptr<uint8_t>(), (K / BLOCK_K) * BLOCK_BYTES, scales.data_ptr(), half, &act, K, G,
                   group};
  if (amx) {
    amx_dot::gemm(act, M, N, K, group, {pb.w, pb.panel_bytes, false, pb.scales, half, nullptr}, b,
                  y.data_ptr<float>(), y.stride(0));
    return y;
  }
  dot_gemm::for_each_tile(M, N, K, b, y.data_ptr<float>(), y.stride(0),
                          [&](int64_t p, int64_t m, int rows, float* acc) {
#if defined(PAGEDLLM_X86)
                            if (vnni) return (half ? kHalfTiles : kFloatTiles)[rows - 1](pb, p, m, acc);
#endif
                            tile_generic(pb, p, m, rows, acc);
                          });
  return y;
}
