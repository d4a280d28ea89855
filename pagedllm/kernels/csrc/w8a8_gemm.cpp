// W8A8: y[M, N] = x[M, K] @ (scale * int8 W)^T (+ bias) with x quantized per row to int8 at run time
// (dynamic per-token scales) and the products summed in int32 by AVX-512 VNNI (vpdpbusd: 64 u8 x s8
// multiply-adds per instruction, 4x an fp32 FMA's 16). Used for many rows (prefill, large batches), where
// the matmul is compute-bound; it reads the same int8 panels [P, K, 16] as the weight-only q8 kernel, with
// one scale per output column.
//
// AVX2 without VNNI has no such gain (u8 x s8 pairs need sign fix-ups, maddubs + madd + add: as many
// instructions per multiply-add as fp32 FMAs), so only VNNI CPUs run this kernel; callers use the
// weight-only path elsewhere.
//
// vpdpbusd multiplies unsigned by signed bytes: x is stored as xq + 128 (u8) and 128 * sum_k W[n, k] is
// subtracted at the end. Each panel is regrouped per call into k-quads [ceil(K/4), 16, 4] (4 consecutive k
// of one column in a 32-bit lane), zero-padded past K. The tiles are simd/dot_tiles.h's w8a8_tile.
#include "cpu_features.h"
#include "gemm_args.h"
#include "isa_kernels.h"
#include "kernels.h"
#include "tile_loop.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t NR = isa::NR;
constexpr int MR = isa::kW8a8Rows;

// Per row: scale = max|x| / 127, xq = round(x / scale) + 128 as u8 (K padded to a multiple of 4 with 128).
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, uint8_t* xq, float* sx) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = x + m * ldx;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(r[k]));
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      const float inv = 1.f / s;
      uint8_t* q = xq + m * Kp;
      for (int64_t k = 0; k < K; ++k) q[k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(r[k] * inv)) + 128);
      for (int64_t k = K; k < Kp; ++k) q[k] = 128;
      sx[m] = s;
    }
  });
}

// Panel [K, 16] -> k-quads [Kp/4, 16, 4] (zero-padded) and 128 times the per-column sums of the weights (what
// x's offset of 128 adds to every product).
void regroup_panel(const int8_t* panel, int64_t K, int64_t Kp, int8_t* quads, int32_t* colsum128) {
  std::fill(colsum128, colsum128 + NR, 0);
  for (int64_t k = 0; k < Kp; ++k) {
    for (int j = 0; j < NR; ++j) {
      const int8_t v = k < K ? panel[k * NR + j] : 0;
      quads[(k / 4) * 64 + j * 4 + (k % 4)] = v;
      colsum128[j] += 128 * v;
    }
  }
}

// The running thread's regrouped panel.
thread_local std::vector<int8_t> t_quads;
thread_local int32_t t_colsum128[NR];

// The W8A8 tiles of the best ISA here, or nullptr (they need an exact byte dot product: AVX-512 VNNI).
const isa::W8a8Tile* w8a8_tiles() {
  const isa::W8a8Tile* tiles = isa::kernels_for(ISA_AUTO).dot->w8a8;
  return tiles[0] != nullptr ? tiles : nullptr;
}

}  // namespace

bool w8a8_supported() { return w8a8_tiles() != nullptr; }

torch::Tensor w8a8_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                        int64_t out_features, const std::optional<torch::Tensor>& bias,
                        const std::optional<torch::Tensor>& out) {
  const isa::W8a8Tile* tiles = w8a8_tiles();
  TORCH_CHECK(tiles != nullptr, "w8a8_gemm needs AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = (N + NR - 1) / NR;
  TORCH_CHECK(K > 0 && N > 0, "empty matmul");
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == torch::kInt8 && qweight.dim() == 3 &&
              qweight.size(0) == P && qweight.size(1) == K && qweight.size(2) == NR,
              "qweight must be contiguous int8 [P, K, 16]");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == P * NR,
              "scales must be float32 [P, 1, 16] (one per output column)");
  const torch::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  torch::Tensor bc;
  const float* b = gemm_bias(bias, N, bc);
  torch::Tensor y = gemm_output(out, M, N, x.options());
  if (M == 0) return y;
  const int64_t Kp = (K + 3) / 4 * 4;
  std::vector<uint8_t> xq(static_cast<size_t>(M * Kp));
  std::vector<float> sx(static_cast<size_t>(M));
  quantize_rows(xc.data_ptr<float>(), xc.stride(0), M, K, Kp, xq.data(), sx.data());
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* sw = scales.data_ptr<float>();
  // Row blocks of x (u8, all of K) of ~128 KiB stay in L2 across a thread's panels.
  const TileLoop loop{MR, (128 * 1024) / Kp / MR * MR, int64_t{1} << 16};
  for_each_tile(
      M, N, K, loop, b, y.data_ptr<float>(), y.stride(0),
      [&](int64_t p) {
        t_quads.resize(static_cast<size_t>(Kp * NR));
        regroup_panel(w + p * K * NR, K, Kp, t_quads.data(), t_colsum128);
      },
      [&](int64_t p, int64_t m, int rows, float* tmp) {
        tiles[rows - 1](xq.data() + m * Kp, Kp, t_quads.data(), t_colsum128, sx.data() + m, sw + p * NR, tmp);
      });
  return y;
}
