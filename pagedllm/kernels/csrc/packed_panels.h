// The fp32 panel microkernel of packed_gemm.cpp, shared with quant_gemm.cpp: quantized weights with many rows
// dequantize one panel at a time into a float buffer and run these tiles (the same code as fp32 weights).
#pragma once
#include <cstdint>

constexpr int64_t PACKED_MR = 6;  // rows per register tile (x tiles are packed in groups of this many rows)

// K chunk length used by panel_rows_packed_x (about 16 KiB of a panel stays in L1 across the row tiles).
int64_t packed_gemm_k_chunk(int64_t K);
// Rows of x (all of K) that fit in about half of L2, in whole tiles.
int64_t packed_gemm_row_block(int64_t K);
// x rows [0, rows) -> dst [ceil(rows / PACKED_MR)][K][PACKED_MR], k-major within each tile (tail padding unset).
void pack_x_tiles(const float* x, int64_t ldx, int64_t rows, int64_t K, float* dst);
// y[0:rows, 0:cols] = xt @ panel (+ bias[0:cols] when bias != nullptr); panel float32 [K, 16], y rows ldy apart.
void panel_rows_packed_x(const float* xt, int64_t rows, const float* panel, int64_t K, int64_t kc, int64_t cols,
                         const float* bias, float* y, int64_t ldy);
