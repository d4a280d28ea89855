// moe_gemm.cpp: the experts of a MoE layer in one call, over rows sorted by expert.
#pragma once
#include <torch/extension.h>

#include <optional>

// y[R, N] (float32): rows [ends[e-1], ends[e]) of x [R, K] times expert e's weight^T, the experts' weights packed
// [E, ceil(N/16), K, 16] (packed_gemm's panels per expert); ends int32 [E] on the CPU, ends[E-1] == R. Experts with
// no rows are not read. out: an optional [R, N] destination.
torch::Tensor moe_packed_gemm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& ends,
                              int64_t out_features, const std::optional<torch::Tensor>& out);
