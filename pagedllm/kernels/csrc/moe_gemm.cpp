// The experts of a mixture-of-experts layer in one call: y[R, N], where x's rows are sorted by expert and the rows
// [ends[e-1], ends[e]) are multiplied by expert e's weight only (fp32 panels [E, P, K, 16], packed_gemm.cpp's
// layout, one [P, K, 16] block per expert).
//
// Threads take work items (expert, range of panels): every expert with rows this step is split into enough panel
// ranges that the items keep the threads busy, so a decode token's k experts are read in parallel and the other
// experts' weights are never touched. Each item runs packed_gemm's microkernel (packed_panels.h) on its expert's rows,
// packed into k-major tiles once per row block.
#include "moe_gemm.h"

#include "gemm_args.h"
#include "moe_items.h"
#include "packed_panels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t NR = 16;
constexpr int64_t MIN_ITEM_WORK = int64_t{1} << 18;  // multiply-adds per item at least (as packed_gemm's grain)

using moe_items::Item;

// All rows of one item: row blocks that stay in L2, each packed once, then the item's panels over them.
void run_item(const Item& it, const float* x, int64_t ldx, const float* packed, int64_t P, int64_t K, int64_t N,
              float* y, int64_t ldy) {
  thread_local std::vector<float> xt;
  const int64_t kc = packed_gemm_k_chunk(K);
  const int64_t block = packed_gemm_row_block(K);
  const float* expert_panels = packed + it.expert * P * K * NR;
  for (int64_t mb = 0; mb < it.rows; mb += block) {
    const int64_t rows = std::min(block, it.rows - mb);
    xt.resize(static_cast<size_t>((rows + PACKED_MR - 1) / PACKED_MR * PACKED_MR * K));
    pack_x_tiles(x + (it.row0 + mb) * ldx, ldx, rows, K, xt.data());
    for (int64_t p = it.p0; p < it.p1; ++p) {
      const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
      panel_rows_packed_x(xt.data(), rows, expert_panels + p * K * NR, K, kc, cols, nullptr,
                          y + (it.row0 + mb) * ldy + n0, ldy);
    }
  }
}

}  // namespace

torch::Tensor moe_packed_gemm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& ends,
                              int64_t out_features, const std::optional<torch::Tensor>& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [R, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(3) == NR && packed.scalar_type() == torch::kFloat32 &&
              packed.is_contiguous(), "packed experts must be contiguous float32 [E, ceil(N/16), K, 16]");
  const int64_t E = packed.size(0), P = packed.size(1), K = packed.size(2), N = out_features, R = x.size(0);
  TORCH_CHECK(ends.size(0) == E, "ends has ", ends.size(0), " experts, the packed weights ", E);
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the packed experts ", K);
  TORCH_CHECK(N > 0 && (N + NR - 1) / NR == P, "out_features ", N, " does not match the packing");
  const torch::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  torch::Tensor y = gemm_output(out, R, N, x.options());
  const std::vector<Item> items = moe_items::expert_items(ends, R, P, K, MIN_ITEM_WORK);
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = xc.stride(0), ldy = y.stride(0);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) run_item(items[i], xp, ldx, wp, P, K, N, yp, ldy);
  });
  return y;
}
