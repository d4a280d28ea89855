// Argument checks shared by the matmul kernels (packed_gemm.cpp, quant_gemm.cpp, w8a8_gemm.cpp): the
// optional bias and the optional `out=` destination mean the same thing for all of them.
#pragma once
#include <torch/extension.h>

#include <optional>

// The bias as a float pointer (nullptr when absent); `keep` holds the contiguous copy alive.
inline const float* gemm_bias(const std::optional<torch::Tensor>& bias, int64_t N, torch::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == torch::kFloat32 && keep.numel() == N, "bias must be float32 [N]");
  return keep.data_ptr<float>();
}

// The [M, N] result of `options`' type (float32 for every caller but the bf16 experts): `out` when given (rows
// contiguous, possibly strided), else a new tensor.
inline torch::Tensor gemm_output(const std::optional<torch::Tensor>& out, int64_t M, int64_t N,
                                 const torch::TensorOptions& options) {
  if (!out.has_value() || !out->defined()) return torch::empty({M, N}, options);
  const torch::Tensor& y = *out;
  const auto type = c10::typeMetaToScalarType(options.dtype());
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.scalar_type() == type && y.stride(1) == 1 &&
              y.stride(0) >= N, "out must be ", type == torch::kFloat32 ? "float32" : c10::toString(type),
              " [M, N] with contiguous rows");
  return y;
}
