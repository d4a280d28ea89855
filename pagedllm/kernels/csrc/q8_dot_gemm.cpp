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
// The tiles are simd/dot_tiles.h's q8_dot_tile, chosen by isa::kernels_for: AVX-512 VNNI (isa 0 or 2 on a CPU
// with VNNI) or the portable loop (isa 3), which serves tests and other CPUs, where the autotuner
// (kernel_choice.py) keeps the widening kernel. AVX2 has no exact u8 x s8 byte product for full-range bytes.
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
constexpr int64_t BLOCK_K = 4;  // k per 64-byte block
constexpr int64_t BLOCK_BYTES = 64;

}  // namespace

bool q8_dot_supported() { return isa::has_byte_dot(); }

torch::Tensor q8_dot_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                          int64_t group, int64_t out_features, const std::optional<torch::Tensor>& bias,
                          const std::optional<torch::Tensor>& out, int64_t isa_code) {
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
  const bool amx = isa_code == ISA_AMX, words = (isa_code & ISA_WORDS) != 0;
  TORCH_CHECK(!amx || amx_dot::supported(), "q8_dot_gemm: isa 4 (AMX) on a CPU without AMX tiles");
  TORCH_CHECK(!words || group <= words_gemm::MAX_Q8_GROUP, "q8_dot_gemm: the words tiles take groups of at most ",
              words_gemm::MAX_Q8_GROUP, " k, got ", group);
  // AMX splits x as AVX-512 does
  const isa::Kernels& kernels = isa::kernels_for(amx ? ISA_AVX512 : isa_code & ~ISA_WORDS);
  const isa::DotTile* tiles = half ? kernels.dot->q8_half : kernels.dot->q8_float;
  TORCH_CHECK(words || tiles[0] != nullptr, "q8_dot_gemm runs on AVX-512 VNNI (isa 0 or 2), the portable path ",
              "(isa 3) or the words tiles of any ISA (isa | 8); asked for isa ", isa_code, " (", kernels.name, ")");
  const torch::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  torch::Tensor bc;
  const float* b = gemm_bias(bias, N, bc);
  torch::Tensor y = gemm_output(out, M, N, x.options());
  if (M == 0) return y;

  dot_gemm::Activations act;
  dot_gemm::quantize_activations(xc.data_ptr<float>(), xc.stride(0), M, K, group, act, kernels.dot->split_group);
  const isa::DotProblem pb = dot_gemm::dot_problem(act, qweight.data_ptr<uint8_t>(), (K / BLOCK_K) * BLOCK_BYTES,
                                                   scales.data_ptr(), half, nullptr, K, group);
  const dot_gemm::Weights wt{pb.w, pb.panel_bytes, false, pb.scales, half, nullptr};
  if (amx) {
    amx_dot::gemm(act, M, N, K, group, wt, b, y.data_ptr<float>(), y.stride(0));
    return y;
  }
  if (words) {
    words_gemm::gemm(act, M, N, K, group, wt, *kernels.words, b, y.data_ptr<float>(), y.stride(0));
    return y;
  }
  for_each_tile(M, N, K, dot_tile_loop(K), b, y.data_ptr<float>(), y.stride(0), no_panel_setup,
                [&](int64_t p, int64_t m, int rows, float* acc) { tiles[rows - 1](pb, p, m, acc); });
  return y;
}
