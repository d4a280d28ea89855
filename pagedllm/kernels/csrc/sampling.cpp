// Sampling from softmax(logits / temperature) by inverse CDF, one row per request, without materialising
// the probabilities: the torch path (softmax, cumsum, searchsorted) writes three [B, vocab] tensors per
// step, ~40 MB each at 200 rows of a 49k vocabulary, and on the default model cost ~45 ms of a ~600 ms
// decode step. Here each row is read twice (max, then every weight once, keeping per-chunk sums) and one chunk of
// 64 a third time (the walk to the target).
//
// Shapes: logits [B, V] float32 (rows contiguous, may be strided), temperature [B] float32 (> 0),
// uniform [B] float32 in [0, 1); returns [B] int64.
//
// Masked tokens arrive as -inf (grammar bitmask, min_tokens, top-k). The extension is built with -ffast-math,
// which lets the compiler assume no value is infinite or NaN (std::isfinite may fold to true, inf - inf
// is "impossible"), so nothing here relies on infinities: a logit at or below MASKED is treated as masked
// by an explicit comparison with a finite bound, and its probability is a literal 0.
#include "kernels.h"
#include "row_max.h"
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include "simd/exp2_poly.h"
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Logits at or below this are masked. Finite on purpose: fast-math may mis-compile comparisons with inf.
constexpr float MASKED = -1e30f;

// exp((x - max_l) * inv_t), or exactly 0 for a masked logit (a select, so the loops still vectorize).
inline float weight(float x, float max_l, float inv_t) {
  return x > MASKED ? expf((x - max_l) * inv_t) : 0.f;  // libmvec under -ffast-math
}

constexpr int64_t CH = 64;  // logits per chunk of the draw's running sum

// The weights of one chunk of n <= CH logits into w[0:n], exp((x - max_l) * inv_t) or 0 for a masked logit; returns
// their sum. sample_row computes every weight here, so the chunk sums it skips by and the walk through the chunk
// that crosses the target see the same values. With AVX-512 by exp2_poly (relative error < 3e-6, about 3x fewer
// instructions than libmvec's expf), elsewhere by weight().
inline float chunk_weights(const float* l, int64_t n, float max_l, float inv_t, float* w) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if (n == CH) {
    const __m512 max_v = _mm512_set1_ps(max_l), scale = _mm512_set1_ps(inv_t * LOG2E);
    const __m512 masked = _mm512_set1_ps(MASKED), floor_t = _mm512_set1_ps(-150.f);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < CH; j += 16) {
      const __m512 x = _mm512_loadu_ps(l + j);
      // t >= -150: a masked logit's (x - max) * scale may overflow; its weight is set to 0 below anyway.
      const __m512 t = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(x, max_v), scale), floor_t);
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, masked, _CMP_GT_OQ), exp2_poly(t));
      _mm512_storeu_ps(w + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
  }
#endif
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    w[j] = weight(l[j], max_l, inv_t);
    sum += w[j];
  }
  return sum;
}

int64_t sample_row(const float* l, int64_t V, float inv_t, float u) {
  const float max_l = std::max(MASKED, row_max(l, V));
  if (!(max_l > MASKED)) return 0;  // every logit masked: nothing to sample, like argmax
  // One pass computes every weight once, keeping the sum of each chunk of CH; the draw then skips whole chunks by
  // their sums and walks only the chunk where the running sum reaches the target (the row itself stays in L2).
  const int64_t chunks = (V + CH - 1) / CH;
  thread_local std::vector<float> sums;
  sums.resize(static_cast<size_t>(chunks));
  alignas(64) float w[CH];
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    sums[c] = chunk_weights(l + c * CH, std::min(CH, V - c * CH), max_l, inv_t, w);
    total += sums[c];
  }
  // 1 - u lies in (0, 1]: a token of probability 0 can never be the first whose running sum reaches it.
  const float target = (1.f - u) * total;
  float run = 0.f;
  int64_t last = 0;  // the last drawable token walked
  for (int64_t c = 0; c < chunks; ++c) {
    if (run + sums[c] < target) {  // added in the order of total: the last chunk with weight always reaches it
      run += sums[c];
      continue;
    }
    const int64_t n = std::min(CH, V - c * CH);
    chunk_weights(l + c * CH, n, max_l, inv_t, w);
    for (int64_t j = 0; j < n; ++j) {
      if (!(w[j] > 0.f)) continue;
      run += w[j];
      last = c * CH + j;
      if (run >= target) return last;
    }
    // Rounding: the walk summed the chunk in another order and fell just short; the next chunk with weight crosses.
  }
  return last;  // still short after the last chunk: the last token that can be drawn
}

// ---- rows under a grammar bitmask [ceil(V/32)] int32 (bit j of word w allows token 32w + j) ----------------
// Disallowed tokens are skipped a word at a time, so a JSON row allowing a few hundred tokens reads a few
// hundred logits, not V: cheaper than the sampler's old copy + in-place -inf fill + full-row draw.

constexpr int64_t WORD = 32;

inline bool full_word(uint32_t bits, int64_t base, int64_t V) { return bits == 0xFFFFFFFFu && base + WORD <= V; }

// Largest allowed logit of one word (MASKED when none is above it).
inline float word_max(const float* l, uint32_t bits, int64_t base, int64_t V) {
  float m = MASKED;
  if (full_word(bits, base, V)) return std::max(m, row_max(l + base, WORD));
  for (; bits; bits &= bits - 1) {
    const int64_t i = base + __builtin_ctz(bits);
    if (i < V) m = std::max(m, l[i]);
  }
  return m;
}

// Sum of the allowed weights of one word; the same code every time it is called, so the same float.
inline float word_sum(const float* l, uint32_t bits, int64_t base, int64_t V, float max_l, float inv_t) {
  float s = 0.f;
  if (full_word(bits, base, V)) {
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < WORD; ++j) s += weight(l[base + j], max_l, inv_t);
    return s;
  }
  for (; bits; bits &= bits - 1) {
    const int64_t i = base + __builtin_ctz(bits);
    if (i < V) s += weight(l[i], max_l, inv_t);
  }
  return s;
}

// First index of the largest allowed logit (torch.argmax's tie rule); 0 when every allowed logit is masked.
// mask == nullptr: every token allowed.
int64_t argmax_row(const float* l, int64_t V, const int32_t* mask) {
  const int64_t W = (V + WORD - 1) / WORD;
  float best = MASKED;
  int64_t arg = 0;
  for (int64_t w = 0; w < W; ++w) {
    const int64_t base = w * WORD;
    uint32_t bits = mask ? static_cast<uint32_t>(mask[w]) : 0xFFFFFFFFu;
    if (base + WORD > V) bits &= (1u << (V - base)) - 1u;  // the tail word: only tokens < V
    if (!bits || !(word_max(l, bits, base, V) > best)) continue;
    for (; bits; bits &= bits - 1) {
      const int64_t i = base + __builtin_ctz(bits);
      if (l[i] > best) best = l[i], arg = i;
    }
  }
  return arg;
}

int64_t sample_row_masked(const float* l, int64_t V, const int32_t* mask, float inv_t, float u) {
  const int64_t W = (V + WORD - 1) / WORD;
  float max_l = MASKED;
  for (int64_t w = 0; w < W; ++w)
    if (mask[w]) max_l = std::max(max_l, word_max(l, static_cast<uint32_t>(mask[w]), w * WORD, V));
  if (!(max_l > MASKED)) return 0;  // nothing allowed is drawable: token 0, like the unmasked path
  float total = 0.f;
  for (int64_t w = 0; w < W; ++w)
    if (mask[w]) total += word_sum(l, static_cast<uint32_t>(mask[w]), w * WORD, V, max_l, inv_t);
  const float target = (1.f - u) * total;
  float run = 0.f;
  int64_t last_word = -1;
  for (int64_t w = 0; w < W; ++w) {
    const uint32_t bits = static_cast<uint32_t>(mask[w]);
    if (!bits) continue;
    const float s = word_sum(l, bits, w * WORD, V, max_l, inv_t);
    if (!(s > 0.f)) continue;
    last_word = w;
    if (run + s < target) {
      run += s;
      continue;
    }
    // The target falls in this word: walk its allowed tokens (rounding may carry it into a later word).
    for (uint32_t b = bits; b; b &= b - 1) {
      const int64_t i = w * WORD + __builtin_ctz(b);
      if (i >= V) break;
      const float p = weight(l[i], max_l, inv_t);
      run += p;
      if (run >= target && p > 0.f) return i;
    }
  }
  // Rounding left the sum short of the target: the last allowed token that can be drawn.
  int64_t last = 0;
  for (uint32_t b = static_cast<uint32_t>(mask[last_word]); b; b &= b - 1) {
    const int64_t i = last_word * WORD + __builtin_ctz(b);
    if (i < V && weight(l[i], max_l, inv_t) > 0.f) last = i;
  }
  return last;
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

// Greedy rows without a bitmask: argmax_row over every token (torch.argmax's first-index tie rule), with the
// per-word maxima in vectors: torch's argmax took ~60 us of a 49k-vocabulary row on one thread.
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
              "logits must be float32 [B, V] with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "empty vocabulary");
  torch::Tensor out = torch::empty({B}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  const int64_t ld = logits.stride(0);
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) op[b] = argmax_row(lp + b * ld, V, nullptr);
  });
  return out;
}

torch::Tensor sample_masked(const torch::Tensor& logits, const torch::Tensor& temperature,
                            const torch::Tensor& uniform, const torch::Tensor& greedy, const torch::Tensor& bitmask,
                            const torch::Tensor& mask_row) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
              "logits must be float32 [B, V] with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1), W = (V + WORD - 1) / WORD;
  TORCH_CHECK(V > 0, "empty vocabulary");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.size(1) == W,
              "bitmask must be int32 [M, ceil(V/32)]");
  const torch::Tensor t = temperature.to(torch::kFloat32).contiguous();
  const torch::Tensor u = uniform.to(torch::kFloat32).contiguous();
  const torch::Tensor g = greedy.to(torch::kBool).contiguous();
  const torch::Tensor r = mask_row.to(torch::kInt64).contiguous();
  const torch::Tensor m = bitmask.contiguous();
  TORCH_CHECK(t.numel() == B && u.numel() == B && g.numel() == B && r.numel() == B,
              "temperature, uniform, greedy and mask_row must have one value per row");
  const int64_t M = m.size(0);
  torch::Tensor out = torch::empty({B}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  const int64_t ld = logits.stride(0);
  const float* tp = t.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  const bool* gp = g.data_ptr<bool>();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int32_t* mp = m.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(rp[b] < M, "mask_row out of range");
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = lp + b * ld;
      const int32_t* mask = rp[b] >= 0 ? mp + rp[b] * W : nullptr;
      if (gp[b]) op[b] = argmax_row(row, V, mask);
      else if (mask) op[b] = sample_row_masked(row, V, mask, 1.f / tp[b], up[b]);
      else op[b] = sample_row(row, V, 1.f / tp[b], up[b]);  // bit for bit the unconstrained draw
    }
  });
  return out;
}
