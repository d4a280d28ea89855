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
// The tiles are simd/dot_tiles.h's q4_dot_tile, chosen per call by isa::kernels_for (isa as in cpu_features.h:
// 0 = best, 1 = AVX2, 2 = AVX-512, 3 = portable; 4 = AMX tiles, amx_dot.h). AVX-512 runs the VNNI tiles where the
// CPU has VNNI and the AVX2 tiles otherwise. On AVX2 a group of at most 32 k (GGUF's Q4_0/Q4_1) sums its blocks in
// int16 (the "short" tiles: see simd/vec_avx2.h).
#include "amx_dot.h"
#include "cpu_features.h"
#include "dot_gemm.h"
#include "gemm_args.h"
#include "isa_kernels.h"
#include "kernels.h"
#include "tile_loop.h"
#include "words_gemm.h"

namespace {

constexpr int64_t NR = isa::NR;
constexpr int64_t BLOCK_K = 8;  // k per 64-byte block
constexpr int64_t BLOCK_BYTES = 64;
constexpr int64_t SHORT_GROUP_K = 32;  // groups up to this long take the short tiles

}  // namespace

torch::Tensor q4_dot_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                          const torch::Tensor& mins, int64_t group, int64_t out_features,
                          const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                          int64_t isa_code) {
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
  const bool amx = isa_code == ISA_AMX, words = (isa_code & ISA_WORDS) != 0;
  TORCH_CHECK(!amx || amx_dot::supported(), "q4_dot_gemm: isa 4 (AMX) on a CPU without AMX tiles");
  TORCH_CHECK(!words || group <= words_gemm::MAX_Q4_GROUP, "q4_dot_gemm: the words tiles take groups of at most ",
              words_gemm::MAX_Q4_GROUP, " k, got ", group);
  const isa::Kernels& resolved = isa::kernels_for(amx ? ISA_AVX512 : isa_code & ~ISA_WORDS);  // AMX splits x so too
  const isa::DotKernels& kernels = *resolved.dot;
  const torch::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  torch::Tensor bc;
  const float* b = gemm_bias(bias, N, bc);
  torch::Tensor y = gemm_output(out, M, N, x.options());
  if (M == 0) return y;

  dot_gemm::Activations act;
  dot_gemm::quantize_activations(xc.data_ptr<float>(), xc.stride(0), M, K, group, act, kernels.split_group);
  const isa::DotProblem pb = dot_gemm::dot_problem(
      act, qweight.data_ptr<uint8_t>(), (K / BLOCK_K) * BLOCK_BYTES, scales.data_ptr<at::Half>(), true,
      reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), K, group);
  const dot_gemm::Weights wt{pb.w, pb.panel_bytes, true, pb.scales, true, pb.mins};
  if (amx) {
    amx_dot::gemm(act, M, N, K, group, wt, b, y.data_ptr<float>(), y.stride(0));
    return y;
  }
  if (words) {
    words_gemm::gemm(act, M, N, K, group, wt, *resolved.words, b, y.data_ptr<float>(), y.stride(0));
    return y;
  }
  const isa::DotTile* tiles = group <= SHORT_GROUP_K ? kernels.q4_short : kernels.q4;
  for_each_tile(M, N, K, dot_tile_loop(K), b, y.data_ptr<float>(), y.stride(0), no_panel_setup,
                [&](int64_t p, int64_t m, int rows, float* acc) { tiles[rows - 1](pb, p, m, acc); });
  return y;
}
