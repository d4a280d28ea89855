// The byte-dot-product weights (q4_dot_gemm.cpp's dot8, q8_dot_gemm.cpp's dot4) times many rows, by int16 pair
// products instead of byte ones: isa code | ISA_WORDS (cpu_features.h) on those two kernels.
//
// Why: the byte tiles take two products per 4 k (one per int8 term of x) and scale every group's two sums in
// float, so for many rows, where a matmul is bound by arithmetic rather than by the weight's bytes, they run at
// about half of what the same CPU multiplies in bf16. Here x is one int16 term, x16 = 254 * x1 + x2 (exactly the
// two terms combined: |x16| <= 32385), and a tile's panels are widened once per block of rows into int16 pairs
// [K/2][16], so each group's integer sum D = sum_k q x16 = 254 * d1 + d2 takes one pair product per 2 k and one
// conversion:
//   y[m, n] += scale[n, g] * (D - offset) * dx / 254 (+ min[n, g] * sum_k x[m, k])
// the same real number as the byte tiles' scale * (dx * d1 + dx / 254 * d2), rounded once instead of twice: the
// two agree within float32 rounding (the autotuner's candidates all do), not bit for bit.
//
// D stays exact in int32 while group * (largest level) * 32385 < 2^31: groups up to 4096 for 4-bit levels (0..15),
// up to 256 for 8-bit ones stored + 128 (0..255, the offset 128 * sum_k x16 subtracted per group).
#pragma once
#include "dot_gemm.h"
#include "isa_kernels.h"

#include <cstdint>

namespace words_gemm {

constexpr int64_t MAX_Q4_GROUP = 4096, MAX_Q8_GROUP = 256;

// y[M, N] (+ bias) = x @ w^T, x given as its two int8 terms.
void gemm(const dot_gemm::Activations& a, int64_t M, int64_t N, int64_t K, int64_t group, const dot_gemm::Weights& wt,
          const isa::WordKernels& kernels, const float* bias, float* y, int64_t ldy);

}  // namespace words_gemm
