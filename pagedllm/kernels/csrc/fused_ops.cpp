// Element-wise steps of a decoder layer fused into single passes over memory (float32).
// Each replaces several torch ops (and their temporaries); per decode step a 30-layer model runs ~10 of
// these per layer, so at small batches the launch and allocation cost matters as much as the arithmetic.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [T, C] with contiguous rows");
}

}  // namespace

// x [T, C], residual [T, C] or none, weight [C]. In place: with a residual, residual = x + residual and
// x = rms_norm(residual) * weight; without, x = rms_norm(x) * weight.
void rms_norm_(torch::Tensor& x, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
               double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(), "weight must be float32");
  const int64_t T = x.size(0), C = x.size(1);
  TORCH_CHECK(weight.numel() == C, "weight must have ", C, " elements");
  float* res = nullptr;
  int64_t res_stride = 0;
  if (residual.has_value() && residual->defined()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->size(0) == T && residual->size(1) == C, "residual must match x");
    res = residual->data_ptr<float>();
    res_stride = residual->stride(0);
  }
  float* xp = x.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const float* w = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = xp + t * x_stride;
      float ss = 0.f;
      if (res) {
        float* r = res + t * res_stride;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < C; ++c) {
          const float v = row[c] + r[c];
          r[c] = v;
          row[c] = v;
          ss += v * v;
        }
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < C; ++c) ss += row[c] * row[c];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + feps);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) row[c] = w[c] * (row[c] * inv);
    }
  });
}

// qk [T, >= num_heads * D] (rows may be strided: the fused qkv output), positions [T] int64,
// cos_sin [P, D] = [cos | sin] per position. Rotates the first num_heads heads of every row in place,
// rotate-half pairing (element i with i + D/2).
void rotary_(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos_sin, int64_t num_heads,
             int64_t head_dim) {
  check_rows(qk, "qk");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous() && cos_sin.size(1) == head_dim,
              "cos_sin must be float32 [P, head_dim]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == qk.size(0), "positions [T] int64");
  TORCH_CHECK(qk.size(1) >= num_heads * head_dim && head_dim % 2 == 0, "qk too narrow for num_heads");
  const int64_t T = qk.size(0), half = head_dim / 2, stride = qk.stride(0), P = cos_sin.size(0);
  float* base = qk.data_ptr<float>();
  const float* cs = cos_sin.data_ptr<float>();
  const torch::Tensor pos_c = positions.contiguous();
  const int64_t* pos = pos_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position out of range");
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pos[t] * head_dim;
      const float* s = c + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x1 = base + t * stride + h * head_dim;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// gate_up [T, 2I] = [gate | up] -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up width must be even");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  torch::Tensor out = torch::empty({T, I}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = in + t * stride;
      const float* u = g + I;
      float* o = op + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
  });
  return out;
}
