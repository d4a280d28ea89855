// What the byte-dot-product matmuls share (q4_dot_gemm.cpp: 4-bit weights, q8_dot_gemm.cpp: 8-bit weights):
// float32 activations split into two int8 terms per (row, weight group), and the loop over panels and row tiles.
//
// x is split per (row, group) as x ~= dx * x1 + (dx / 254) * x2, with dx = max|x| / 127: x1 as llama.cpp's Q8
// blocks, x2 the rounding residual of x1 (|x - dx * x1| <= dx / 2, so x2 fits in int8 too). One int8 term alone
// moved the default model's perplexity by 2%; two leave x with ~16-bit precision, and the second costs one more
// dot product per 4 weights, not another unpacking of the weights.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace dot_gemm {

constexpr int64_t NR = 16;               // output columns per panel
constexpr int MR = 4;                    // rows per tile
constexpr float RESIDUAL_STEPS = 254.f;  // x2's step is dx / 254: |residual| <= dx / 2 -> |x2| <= 127

// x split per (row, group): x1, x2 int8 [M, K]; dx = max|x| / 127 and xs = sum(x), float [M, G]; the integer
// sums of x1 and x2 over each group, int32 [M, G] (what a weight offset of +128 adds to a u8 x s8 dot product).
struct Activations {
  std::vector<int8_t> x1, x2;
  std::vector<float> d, s;
  std::vector<int32_t> s1, s2;
};

inline void quantize_activations(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, Activations& a) {
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
        const float* r = x + m * ldx + g * group;
        float amax = 0.f, sum = 0.f;
        for (int64_t k = 0; k < group; ++k) {
          amax = std::max(amax, std::fabs(r[k]));
          sum += r[k];
        }
        const float d = amax / 127.f;
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* q1 = a.x1.data() + m * K + g * group;
        int8_t* q2 = a.x2.data() + m * K + g * group;
        int32_t s1 = 0, s2 = 0;
        for (int64_t k = 0; k < group; ++k) {
          const float v = r[k] * inv;  // in units of dx
          const float l1 = std::nearbyint(v);
          q1[k] = static_cast<int8_t>(l1);
          q2[k] = static_cast<int8_t>(std::clamp(std::nearbyint((v - l1) * RESIDUAL_STEPS), -127.f, 127.f));
          s1 += q1[k];
          s2 += q2[k];
        }
        a.d[m * G + g] = d;
        a.s[m * G + g] = sum;
        a.s1[m * G + g] = s1;
        a.s2[m * G + g] = s2;
      }
    }
  });
}

// y[M, N] (+ bias) from tiles: tile(p, m0, rows, acc) writes rows x 16 results of panel p, rows m0.., into acc
// [rows][16]. Threads split the panels; at least ~256k multiply-adds each, so small matmuls stay on one thread.
// Row blocks of int8 x (two terms) of ~128 KiB stay in L2 across a thread's panels; a panel stays in L1 across
// a block's row tiles.
template <typename Tile>
void for_each_tile(int64_t M, int64_t N, int64_t K, const float* bias, float* y, int64_t ldy, const Tile& tile) {
  const int64_t P = (N + NR - 1) / NR;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, M * K * NR));
  const int64_t mblock = std::max<int64_t>(MR, (64 * 1024) / K / MR * MR);
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    float tmp[MR * NR];
    for (int64_t mb = 0; mb < M; mb += mblock)
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
        const int64_t me = std::min(M, mb + mblock);
        for (int64_t m = mb; m < me; m += MR) {
          const int rows = static_cast<int>(std::min<int64_t>(MR, me - m));
          tile(p, m, rows, tmp);
          for (int i = 0; i < rows; ++i) {
            float* yr = y + (m + i) * ldy + n0;
            const float* t = tmp + i * NR;
            if (bias != nullptr) {
              for (int64_t j = 0; j < cols; ++j) yr[j] = t[j] + bias[n0 + j];
            } else {
              std::memcpy(yr, t, sizeof(float) * cols);
            }
          }
        }
      }
  });
}

}  // namespace dot_gemm
