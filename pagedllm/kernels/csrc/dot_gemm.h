// What the byte-dot-product matmuls share (q4_dot_gemm.cpp: 4-bit weights, q8_dot_gemm.cpp: 8-bit weights):
// float32 activations split into two int8 terms per (row, weight group). The split's vector loop is
// simd/dot_tiles.h's split_group, one per ISA; its scalar tail and its rounding rule are here.
//
// x is split per (row, group) as x ~= dx * x1 + (dx / 254) * x2, with dx = max|x| / 127: x1 as llama.cpp's Q8
// blocks, x2 the rounding residual of x1 (|x - dx * x1| <= dx / 2, so x2 fits in int8 too). One int8 term alone
// moved the default model's perplexity by 2%; two leave x with ~16-bit precision, and the second costs one more
// dot product per 4 weights, not another unpacking of the weights.
#pragma once
#include "isa_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

namespace dot_gemm {

constexpr int64_t NR = isa::NR;          // output columns per panel
constexpr float RESIDUAL_STEPS = 254.f;  // x2's step is dx / 254: |residual| <= dx / 2 -> |x2| <= 127

// An allocator whose resize leaves new elements uninitialised: buffers that a kernel writes in full before reading
// (zero-filling the activations of a many-row call cost a few percent of it).
template <class T>
struct Uninitialised : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = Uninitialised<U>;
  };
  using std::allocator<T>::allocator;
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
};
template <class T>
using Buffer = std::vector<T, Uninitialised<T>>;

// x split per (row, group): x1, x2 int8 [M, K]; dx = max|x| / 127 and xs = sum(x), float [M, G]; the integer
// sums of x1 and x2 over each group, int32 [M, G] (what a weight offset of +128 adds to a u8 x s8 dot product).
struct Activations {
  Buffer<int8_t> x1, x2;
  Buffer<float> d, s;
  Buffer<int32_t> s1, s2;
};

// One group of one row: x1, x2, and (dx, sum x, sum x1, sum x2). Every path rounds as the portable one does
// (nearbyint: to nearest, ties to even) and gives the same x1 and x2; the float sum may differ in its last bits.
// The residual is taken from the unrounded x * inv by a fused multiply-add in every path, so no compiler's
// choice to contract (or not) x * inv - x1 changes x2.
inline float residual(float x, float inv, float l1) { return std::fma(x, inv, -l1) * RESIDUAL_STEPS; }

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

// x [M, K] (rows ldx apart) -> a, one group of one row at a time by `split` (the tiles' ISA).
inline void quantize_activations(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, Activations& a,
                                 isa::SplitGroup split) {
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
        const isa::GroupStats st = split(x + m * ldx + g * group, group, a.x1.data() + m * K + g * group,
                                         a.x2.data() + m * K + g * group);
        a.d[m * G + g] = st.d;
        a.s[m * G + g] = st.sum;
        a.s1[m * G + g] = st.s1;
        a.s2[m * G + g] = st.s2;
      }
    }
  });
}

// One weight in panels of 16 output columns (P = ceil(N / 16), panel p at w + p * panel_bytes), as the AMX tiles
// (amx_dot.h) and the words tiles (words_gemm.h) take it.
struct Weights {
  const uint8_t* w;
  int64_t panel_bytes;
  bool nibbles;          // true: 4-bit "dot8" blocks (8 k per 64 bytes, levels 0..15); false: "dot4" (q + 128)
  const void* scales;    // [P, G, 16] float16 bits, or float when !half_scales
  bool half_scales;
  const uint16_t* mins;  // [P, G, 16] float16 bits (4-bit weights), else nullptr
};

// The tiles' view of a call: weights (w, panel_bytes, scales, half_scales, mins) and these activations.
inline isa::DotProblem dot_problem(const Activations& a, const uint8_t* w, int64_t panel_bytes, const void* scales,
                                   bool half_scales, const uint16_t* mins, int64_t K, int64_t group) {
  return {w, panel_bytes, scales, half_scales, mins, a.x1.data(), a.x2.data(), a.d.data(), a.s.data(),
          a.s1.data(), a.s2.data(), K, K / group, group};
}

}  // namespace dot_gemm
