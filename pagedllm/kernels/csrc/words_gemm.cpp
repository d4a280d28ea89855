// The words path of the byte-dot-product matmuls (words_gemm.h): x as one int16 term, each tile's panels widened
// once per block of rows, threads over groups of panels.
#include "words_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace words_gemm {
namespace {

constexpr int64_t NR = isa::NR;
constexpr int64_t X_BLOCK_BYTES = 256 * 1024;  // x16 rows per block: about a quarter of a core's L2
constexpr int64_t STREAM_BYTES = int64_t{16} << 20;  // outputs larger than this bypass the caches
constexpr int64_t MIN_WORK = int64_t{1} << 20;  // multiply-adds per thread at least

// x16 [M, K], dx / 254 and (8-bit weights) 128 * sum x16 per (row, group), from the two int8 terms.
struct WordActivations {
  dot_gemm::Buffer<int16_t> x16;
  dot_gemm::Buffer<float> dx;
  dot_gemm::Buffer<int32_t> offsets;
};

WordActivations combine(const dot_gemm::Activations& a, int64_t M, int64_t K, int64_t group, bool offsets) {
  const int64_t G = K / group;
  WordActivations w;
  w.x16.resize(static_cast<size_t>(M * K));
  w.dx.resize(static_cast<size_t>(M * G));
  if (offsets) w.offsets.resize(static_cast<size_t>(M * G));
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int8_t* x1 = a.x1.data() + m * K;
      const int8_t* x2 = a.x2.data() + m * K;
      int16_t* x16 = w.x16.data() + m * K;
      for (int64_t k = 0; k < K; ++k)
        x16[k] = static_cast<int16_t>(static_cast<int32_t>(dot_gemm::RESIDUAL_STEPS) * x1[k] + x2[k]);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = m * G + g;
        w.dx[i] = a.d[i] / dot_gemm::RESIDUAL_STEPS;
        if (offsets) w.offsets[i] = 128 * (static_cast<int32_t>(dot_gemm::RESIDUAL_STEPS) * a.s1[i] + a.s2[i]);
      }
    }
  });
  return w;
}

// n values of T in `storage`, starting at a 64-byte boundary: the tiles' vector loads of widened weights must not
// straddle cache lines (malloc aligns to 16 bytes only).
template <class T>
T* aligned_buffer(dot_gemm::Buffer<T>& storage, int64_t n) {
  storage.resize(static_cast<size_t>(n) + 64 / sizeof(T));
  void* p = storage.data();
  size_t space = storage.size() * sizeof(T);
  return static_cast<T*>(std::align(64, sizeof(T) * n, p, space));
}

// Float16 or float32 [P, G, 16] values of panel p -> float [G, 16].
void panel_floats(const isa::WordKernels& k, const void* src, bool half, int64_t p, int64_t G, float* dst) {
  const int64_t n = G * NR, o = p * n;
  if (half) k.widen_halves(static_cast<const uint16_t*>(src) + o, n, dst);
  else std::memcpy(dst, static_cast<const float*>(src) + o, sizeof(float) * n);
}

}  // namespace

void gemm(const dot_gemm::Activations& a, int64_t M, int64_t N, int64_t K, int64_t group, const dot_gemm::Weights& wt,
          const isa::WordKernels& kernels, const float* bias, float* y, int64_t ldy) {
  const int64_t G = K / group, P = (N + NR - 1) / NR, NP = kernels.panels, R = kernels.rows;
  const WordActivations x = combine(a, M, K, group, !wt.nibbles);
  const isa::WordsProblem pb{x.x16.data(), x.dx.data(), a.s.data(), wt.nibbles ? nullptr : x.offsets.data(),
                             K, G, group};
  const isa::WidenPanel widen = wt.nibbles ? kernels.widen_dot8 : kernels.widen_dot4;
  const auto& row_tiles = wt.nibbles ? kernels.q4 : kernels.q8;
  const int64_t tiles = (P + NP - 1) / NP;  // groups of NP panels
  const bool stream = M * N * static_cast<int64_t>(sizeof(float)) > STREAM_BYTES;
  const int64_t row_block = std::max<int64_t>(R, X_BLOCK_BYTES / (2 * K) / R * R);
  const int64_t grain = std::max<int64_t>(1, MIN_WORK / std::max<int64_t>(1, M * K * NP * NR));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    dot_gemm::Buffer<int32_t> q_storage;
    dot_gemm::Buffer<float> scales_storage, mins_storage, acc_storage;
    int32_t* q = aligned_buffer(q_storage, NP * (K / 2) * NR);
    float* scales = aligned_buffer(scales_storage, NP * G * NR);
    float* mins = wt.mins ? aligned_buffer(mins_storage, NP * G * NR) : nullptr;
    float* acc = aligned_buffer(acc_storage, R * NP * NR);
    for (int64_t mb = 0; mb < M; mb += row_block) {
      const int64_t me = std::min(M, mb + row_block);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p0 = t * NP, np = std::min(NP, P - p0);
        for (int64_t j = 0; j < np; ++j) {
          widen(wt.w + (p0 + j) * wt.panel_bytes, K, q + j * (K / 2) * NR);
          panel_floats(kernels, wt.scales, wt.half_scales, p0 + j, G, scales + j * G * NR);
          if (wt.mins) panel_floats(kernels, wt.mins, true, p0 + j, G, mins + j * G * NR);
        }
        const isa::WidenedPanels panels{q, scales, mins};
        const int64_t n0 = p0 * NR, cols = std::min(np * NR, N - n0), width = np * NR;
        for (int64_t m = mb; m < me; m += R) {
          const int rows = static_cast<int>(std::min(R, me - m));
          row_tiles[np - 1][rows - 1](pb, panels, m, acc);
          kernels.store_rows(acc, rows, width, cols, bias != nullptr ? bias + n0 : nullptr, y + m * ldy + n0, ldy,
                             stream);
        }
      }
    }
  });
}

}  // namespace words_gemm
