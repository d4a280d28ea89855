// The loop every quantized matmul runs around its tiles (quant_gemm.cpp, q4_dot_gemm.cpp, q8_dot_gemm.cpp,
// w8a8_gemm.cpp): threads split the 16-column weight panels; rows go in blocks whose activations stay in L2 across
// a thread's panels, and a panel stays in L1 across a block's row tiles.
#pragma once
#include "isa_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

struct TileLoop {
  int rows;            // rows per tile (at most isa::kMaxWidenRows)
  int64_t row_block;   // rows per block
  int64_t min_work;    // multiply-adds per thread at least, so small matmuls stay on one thread
};

// y[M, N] (+ bias) from tiles: begin_panel(p) runs before a block's tiles of panel p (on the thread that runs
// them), then tile(p, m0, rows, tmp) writes rows x 16 results into tmp [rows][16]; only the panel's valid
// columns reach y.
template <class BeginPanel, class Tile>
void for_each_tile(int64_t M, int64_t N, int64_t K, const TileLoop& loop, const float* bias, float* y, int64_t ldy,
                   const BeginPanel& begin_panel, const Tile& tile) {
  constexpr int64_t NR = isa::NR;
  const int64_t P = (N + NR - 1) / NR;
  const int64_t grain = std::max<int64_t>(1, loop.min_work / std::max<int64_t>(1, M * K * NR));
  const int64_t row_block = std::max<int64_t>(loop.rows, loop.row_block);
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    float tmp[isa::kMaxWidenRows * NR];
    for (int64_t mb = 0; mb < M; mb += row_block) {
      const int64_t me = std::min(M, mb + row_block);
      for (int64_t p = p0; p < p1; ++p) {
        begin_panel(p);
        const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
        for (int64_t m = mb; m < me; m += loop.rows) {
          const int rows = static_cast<int>(std::min<int64_t>(loop.rows, me - m));
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
    }
  });
}

// No work before a panel's tiles.
inline void no_panel_setup(int64_t) {}

// The byte-dot matmuls' loop (q4_dot_gemm.cpp, q8_dot_gemm.cpp): 4-row tiles, row blocks of ~64 KiB of each int8
// term of x, at least ~256k multiply-adds a thread.
inline TileLoop dot_tile_loop(int64_t K) {
  const int64_t rows = isa::kDotRows;
  return {isa::kDotRows, std::max<int64_t>(rows, (64 * 1024) / K / rows * rows), int64_t{1} << 18};
}
