// How the MoE expert matmuls (moe_gemm.cpp, moe_quant_gemm.cpp) split a call into work items for the threads.
#pragma once
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace moe_items {

// One thread's work: rows [row0, row0 + rows) (one expert's run of the sorted rows) times panels [p0, p1).
struct Item {
  int64_t expert, row0, rows, p0, p1;
};

// Every expert with rows (ends int32 [E] on the CPU: the end of each expert's run, ends[E-1] == R), its P panels
// cut into ranges of at least min_work multiply-adds and at most one per thread: one decode token gives k experts x
// threads items; a prefill few items per expert, so its rows are prepared few times.
inline std::vector<Item> expert_items(const torch::Tensor& ends, int64_t R, int64_t P, int64_t K, int64_t min_work) {
  TORCH_CHECK(ends.dim() == 1 && ends.scalar_type() == torch::kInt32 && ends.device().is_cpu(),
              "ends must be int32 [E] on the CPU");
  const torch::Tensor endc = ends.contiguous();
  const int32_t* e_end = endc.data_ptr<int32_t>();
  const int64_t E = endc.size(0);
  TORCH_CHECK(E == 0 || e_end[E - 1] == R, "ends[-1] (", E ? e_end[E - 1] : 0, ") must equal the rows of x (", R, ")");
  const int64_t threads = at::get_num_threads();
  std::vector<Item> items;
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t end = e_end[e];
    TORCH_CHECK(end >= start && end <= R, "ends must be non-decreasing and at most the rows of x");
    const int64_t rows = end - start;
    if (rows > 0) {
      const int64_t by_work = std::max<int64_t>(1, min_work / std::max<int64_t>(1, rows * K * 16));
      const int64_t chunk = std::max(by_work, std::max<int64_t>(1, P / threads));
      for (int64_t p0 = 0; p0 < P; p0 += chunk) items.push_back({e, start, rows, p0, std::min(P, p0 + chunk)});
    }
    start = end;
  }
  return items;
}

}  // namespace moe_items
