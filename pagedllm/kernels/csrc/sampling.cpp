// Sampling from softmax(logits / temperature) by inverse CDF, one row per request, without materialising
// the probabilities: the torch path (softmax, cumsum, searchsorted) writes three [B, vocab] tensors per
// step, ~40 MB each at 200 rows of a 49k vocabulary, and on the default model cost ~45 ms of a ~600 ms
// decode step. Here each row is read twice (max, then the running sum until it passes the target).
//
// Shapes: logits [B, V] float32 (rows contiguous, may be strided), temperature [B] float32 (> 0),
// uniform [B] float32 in [0, 1); returns [B] int64.
//
// Masked tokens arrive as -inf (grammar bitmask, min_tokens, top-k). The extension is built with -ffast-math,
// which lets the compiler assume no value is infinite or NaN (std::isfinite may fold to true, inf - inf
// is "impossible"), so nothing here relies on infinities: a logit at or below MASKED is treated as masked
// by an explicit comparison with a finite bound, and its probability is a literal 0.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

// Logits at or below this are masked. Finite on purpose: fast-math may mis-compile comparisons with inf.
constexpr float MASKED = -1e30f;

// exp((x - max_l) * inv_t), or exactly 0 for a masked logit (a select, so the loops still vectorize).
inline float weight(float x, float max_l, float inv_t) {
  return x > MASKED ? expf((x - max_l) * inv_t) : 0.f;  // libmvec under -ffast-math
}

int64_t sample_row(const float* l, int64_t V, float inv_t, float u) {
  float max_l = MASKED;
#pragma omp simd reduction(max : max_l)
  for (int64_t i = 0; i < V; ++i) max_l = std::max(max_l, l[i]);
  if (!(max_l > MASKED)) return 0;  // every logit masked: nothing to sample, like argmax
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < V; ++i) total += weight(l[i], max_l, inv_t);
  // 1 - u lies in (0, 1]: a token of probability 0 can never be the first whose running sum reaches it.
  const float target = (1.f - u) * total;
  // Scan in chunks of 64: the chunk sums vectorize; only the chunk that crosses the target is walked.
  float run = 0.f;
  int64_t last_nonzero = 0;
  constexpr int64_t CH = 64;
  int64_t i = 0;
  for (; i + CH <= V; i += CH) {
    float chunk = 0.f;
#pragma omp simd reduction(+ : chunk)
    for (int64_t j = 0; j < CH; ++j) chunk += weight(l[i + j], max_l, inv_t);
    if (run + chunk >= target) break;
    run += chunk;
    if (chunk > 0.f) last_nonzero = i + CH - 1;
  }
  for (; i < V; ++i) {
    const float p = weight(l[i], max_l, inv_t);
    run += p;
    if (p > 0.f) last_nonzero = i;
    if (run >= target && p > 0.f) return i;
  }
  // Rounding left the sum short of the target: the last token that can be drawn.
  while (last_nonzero > 0 && !(weight(l[last_nonzero], max_l, inv_t) > 0.f)) --last_nonzero;
  return last_nonzero;
}

}  // namespace

torch::Tensor sample_from_logits(const torch::Tensor& logits, const torch::Tensor& temperature,
                                 const torch::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
              "logits must be float32 [B, V] with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "empty vocabulary");
  const torch::Tensor t = temperature.to(torch::kFloat32).contiguous();
  const torch::Tensor u = uniform.to(torch::kFloat32).contiguous();
  TORCH_CHECK(t.numel() == B && u.numel() == B, "temperature and uniform must have one value per row");
  torch::Tensor out = torch::empty({B}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  const int64_t ld = logits.stride(0);
  const float* tp = t.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) op[b] = sample_row(lp + b * ld, V, 1.f / tp[b], up[b]);
  });
  return out;
}
