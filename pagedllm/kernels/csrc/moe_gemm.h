// moe_gemm.cpp: the experts of a MoE layer in one call, over rows sorted by expert.
#pragma once
#include <torch/extension.h>

#include <optional>

// y[R, N] (float32): rows [ends[e-1], ends[e]) of x [R, K] times expert e's weight^T, the experts' weights packed
// [E, ceil(N/16), K, 16] (packed_gemm's panels per expert); ends int32 [E] on the CPU, ends[E-1] == R. Experts with
// no rows are not read. out: an optional [R, N] destination.
torch::Tensor moe_packed_gemm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& ends,
                              int64_t out_features, const std::optional<torch::Tensor>& out);

// moe_quant_gemm.cpp: the same for quantized experts, their panels stacked [E, ...] (layout 0 int8, 1 4-bit pairs,
// 2 fp8, 3 dot8, 4 dot4: the dense formats of qpanels.py), scales (and 4-bit mins) [E, ceil(N/16), K/group, 16].
torch::Tensor moe_quant_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                             const std::optional<torch::Tensor>& mins, int64_t layout, int64_t group,
                             int64_t out_features, const torch::Tensor& ends, const std::optional<torch::Tensor>& out,
                             int64_t isa);

// bf16_gemm.cpp: the same for bf16 experts, each packed as bf16_gemm's panels [E, ceil(N/16), K/2, 16, 2]; x and y
// bf16 (float32 sums rounded once). generic: the portable loop (tests; CPUs without AVX-512 BF16).
torch::Tensor moe_bf16_gemm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& ends,
                            int64_t out_features, const std::optional<torch::Tensor>& out, bool generic);

// moe_route.cpp: router logits float32 or bf16 [T, E] -> each token's top_k experts (softmax over all then top-k, the k
// weights renormalised if asked; or with topk_first the top k logits then a softmax over those), the T * k rows sorted
// by expert: token_of int64 [T*k], weight float32 [T*k(, 1)], ends int32 [E] (end of each expert's run).
void moe_route(const torch::Tensor& router_logits, int64_t top_k, bool topk_first, bool renormalize,
               const torch::Tensor& token_of, const torch::Tensor& weight, const torch::Tensor& ends);
// out[r] = x[token_of[r]]: x float32 or bf16 [T, H] -> out [R, H] of x's type.
void moe_gather_rows(const torch::Tensor& x, const torch::Tensor& token_of, const torch::Tensor& out);
// out[t] = sum over rows r of token t of weight[r] * y[r]: y float32 or bf16 [R, H] -> out [T, H] of y's type
// (overwritten; float32 sums rounded once); with a shared expert (Qwen2-MoE), plus sigmoid(shared_gate[t]) *
// shared[t] (shared [T, H] of y's type, shared_gate logits [T, 1]).
void moe_combine(const torch::Tensor& y, const torch::Tensor& token_of, const torch::Tensor& weight,
                 const torch::Tensor& out, const std::optional<torch::Tensor>& shared,
                 const std::optional<torch::Tensor>& shared_gate);
