// The byte-dot-product matmuls (q4_dot_gemm.cpp, q8_dot_gemm.cpp) on AMX tiles, for many rows: the same int8
// activation terms (dot_gemm.h) times the same panels, summed by tdpbsud (16 x 16 x 64 multiply-adds an
// instruction) instead of vpdpbusd (64). Each group's int32 sums are scaled exactly as the VNNI tiles scale
// theirs, so both give the same floats (a choice between them changes speed only).
#pragma once
#include "dot_gemm.h"

#include <cstdint>

namespace amx_dot {

// Whether this CPU has AMX-INT8 and the kernel granted this process the tile state (asked for once).
bool supported();

using dot_gemm::Weights;

// y[M, N] (+ bias) = x @ w^T with x given as its two int8 terms (group a multiple of 4 dividing K; 8 for nibbles).
void gemm(const dot_gemm::Activations& a, int64_t M, int64_t N, int64_t K, int64_t group, const Weights& wt,
          const float* bias, float* y, int64_t ldy);

}  // namespace amx_dot
