// Paged attention's query heads in tiles: a KV head's G query heads are scored and summed a tile of at most 3 at
// a time (what fits the 16 AVX2 registers beside the keys), so each K/V row is loaded once per tile.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

// On each tile's lambda: a call per tile and block left out of line measured ~2% of a decode's attention.
#define PAGEDLLM_INLINE_TILE __attribute__((always_inline))

namespace head_tiles {

constexpr int64_t MAX = 3;

// f(std::integral_constant<int, T>{}, g0) for each tile of T heads starting at head g0: tiles of 3, then the 2 or 1
// left, T a compile-time constant for the row kernels' templates.
template <typename F>
__attribute__((always_inline)) inline void for_each(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += MAX) {
    switch (std::min<int64_t>(MAX, G - g0)) {
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      default: f(std::integral_constant<int, 1>{}, g0); break;
    }
  }
}

}  // namespace head_tiles
