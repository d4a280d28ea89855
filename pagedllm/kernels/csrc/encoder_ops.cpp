// Element-wise steps of an encoder (BERT) layer in single passes over memory. In bfloat16 the layer keeps its
// residual stream and LayerNorms in float32 (bert.py), so plain torch spent as much on the adds, the norms and
// the dtype casts between them as on the attention: here one pass reads the sublayer output and the residual
// and writes the normalised float32 row and the bfloat16 copy the next matmul reads.
#include "bf16_rows.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [T, C] with contiguous rows");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16");
}

template <typename T>
void add_layer_norm_rows(const torch::Tensor& x, const torch::Tensor& residual, const float* w, const float* b,
                         float eps, float* out, at::BFloat16* low) {
  const int64_t rows = x.size(0), C = x.size(1);
  const T* xp = x.data_ptr<T>();
  const float* rp = residual.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(C));
    for (int64_t t = begin; t < end; ++t) {
      float* v = row.data();
      load_row(v, xp + t * xs, C);
      const float* r = rp + t * rs;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < C; ++c) {
        v[c] += r[c];
        sum += v[c];
      }
      const float mean = sum / static_cast<float>(C);
      float var = 0.f;
#pragma omp simd reduction(+ : var)
      for (int64_t c = 0; c < C; ++c) var += (v[c] - mean) * (v[c] - mean);
      const float inv = 1.f / std::sqrt(var / static_cast<float>(C) + eps);
      float* o = out + t * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = (v[c] - mean) * inv * w[c] + b[c];
      if (low != nullptr) store_row(low + t * C, o, 1.f, C);
    }
  });
}

template <typename T>
void gelu_rows(torch::Tensor& x, bool tanh_approx) {
  const int64_t rows = x.size(0), C = x.size(1), xs = x.stride(0);
  T* xp = x.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(C));
    for (int64_t t = begin; t < end; ++t) {
      float* v = row.data();
      load_row(v, xp + t * xs, C);
      if (tanh_approx) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c)
          v[c] = 0.5f * v[c] * (1.f + tanhf(0.7978845608f * (v[c] + 0.044715f * v[c] * v[c] * v[c])));
      } else {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) v[c] = 0.5f * v[c] * (1.f + erff(v[c] * 0.70710678118f));
      }
      store_row(xp + t * xs, v, 1.f, C);
    }
  });
}

}  // namespace

// x [T, C] (float32 or bfloat16), residual [T, C] float32, weight / bias [C] float32 ->
// (out = layer_norm(x + residual) float32 [T, C], its bfloat16 copy if want_bf16 else out itself).
std::tuple<torch::Tensor, torch::Tensor> add_layer_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                        const torch::Tensor& weight, const torch::Tensor& bias,
                                                        double eps, bool want_bf16) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.scalar_type() == torch::kFloat32, "residual must be float32");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must match x");
  const int64_t C = x.size(1);
  for (const torch::Tensor* p : {&weight, &bias})
    TORCH_CHECK(p->scalar_type() == torch::kFloat32 && p->is_contiguous() && p->numel() == C,
                "weight and bias must be float32 [", C, "]");
  torch::Tensor out = torch::empty({x.size(0), C}, residual.options());
  torch::Tensor low = want_bf16 ? torch::empty({x.size(0), C}, residual.options().dtype(torch::kBFloat16)) : out;
  at::BFloat16* lp = want_bf16 ? low.data_ptr<at::BFloat16>() : nullptr;
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == torch::kFloat32) {
    add_layer_norm_rows<float>(x, residual, weight.data_ptr<float>(), bias.data_ptr<float>(), feps,
                               out.data_ptr<float>(), lp);
  } else {
    add_layer_norm_rows<at::BFloat16>(x, residual, weight.data_ptr<float>(), bias.data_ptr<float>(), feps,
                                      out.data_ptr<float>(), lp);
  }
  return {out, low};
}

// In place: x = gelu(x), the erf form or (tanh_approx) the tanh approximation; x [T, C] float32 or bfloat16.
void gelu_(torch::Tensor& x, bool tanh_approx) {
  check_rows(x, "x");
  if (x.scalar_type() == torch::kFloat32) {
    gelu_rows<float>(x, tanh_approx);
  } else {
    gelu_rows<at::BFloat16>(x, tanh_approx);
  }
}
