// The routing side of a MoE layer as kernels, so that a decode step of a MoE model is nothing but kernel calls (a CPU
// step graph records it): router logits -> each token's k experts and weights, the (token, expert) rows sorted by
// expert (stable: token order within an expert), the tokens' rows gathered in that order, and the experts' outputs
// weighted and summed back per token. Every result goes to a tensor the caller allocated (a replay refills it).
// Activations are float32 or bf16 (a bf16 model's rows gathered and summed as they are, the sums in float32 rounded
// once); router logits of either type are scored in float32, as the torch routing does.
#include "moe_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

void moe_route(const torch::Tensor& router_logits, int64_t top_k, bool topk_first, bool renormalize,
               const torch::Tensor& token_of, const torch::Tensor& weight, const torch::Tensor& ends) {
  TORCH_CHECK(router_logits.dim() == 2 && (router_logits.scalar_type() == torch::kFloat32 ||
                                           router_logits.scalar_type() == torch::kBFloat16),
              "router_logits must be float32 or bfloat16 [T, E]");
  const torch::Tensor logits = router_logits.to(torch::kFloat32).contiguous();
  const int64_t T = logits.size(0), E = logits.size(1), R = T * top_k;
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be between 1 and the number of experts");
  TORCH_CHECK(token_of.scalar_type() == torch::kInt64 && token_of.is_contiguous() && token_of.numel() == R,
              "token_of must be contiguous int64 [T * k]");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == R,
              "weight must be contiguous float32 [T * k] or [T * k, 1]");
  TORCH_CHECK(ends.scalar_type() == torch::kInt32 && ends.is_contiguous() && ends.numel() == E,
              "ends must be contiguous int32 [E]");
  const float* lp = logits.data_ptr<float>();
  std::vector<int64_t> ids(static_cast<size_t>(R));
  std::vector<float> ws(static_cast<size_t>(R));
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> score(static_cast<size_t>(E));
    std::vector<int64_t> order(static_cast<size_t>(E));
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = lp + t * E;
      const float mx = *std::max_element(row, row + E);
      if (topk_first) {
        std::copy(row, row + E, score.begin());
      } else {  // softmax over all experts, then the top k of the probabilities
        float sum = 0.f;
        for (int64_t e = 0; e < E; ++e) sum += (score[e] = std::exp(row[e] - mx));
        for (int64_t e = 0; e < E; ++e) score[e] /= sum;
      }
      std::iota(order.begin(), order.end(), int64_t{0});
      // Highest first; equal scores keep the lower expert id first (torch.topk's order on ties is unspecified).
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
        return score[a] > score[b] || (score[a] == score[b] && a < b);
      });
      float* w = ws.data() + t * top_k;
      int64_t* id = ids.data() + t * top_k;
      for (int64_t j = 0; j < top_k; ++j) id[j] = order[j], w[j] = score[order[j]];
      if (topk_first) {  // a softmax over the k chosen logits only
        const float top = w[0];  // the largest (highest first)
        float sum = 0.f;
        for (int64_t j = 0; j < top_k; ++j) sum += (w[j] = std::exp(w[j] - top));
        for (int64_t j = 0; j < top_k; ++j) w[j] /= sum;
      } else if (renormalize) {
        float sum = 0.f;
        for (int64_t j = 0; j < top_k; ++j) sum += w[j];
        for (int64_t j = 0; j < top_k; ++j) w[j] /= sum;
      }
    }
  });
  // Counting sort by expert, stable in (token, slot) order.
  int32_t* end = ends.data_ptr<int32_t>();
  std::vector<int64_t> next(static_cast<size_t>(E), 0);
  for (int64_t r = 0; r < R; ++r) ++next[ids[r]];
  int64_t acc = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = next[e];
    next[e] = acc;
    acc += count;
    end[e] = static_cast<int32_t>(acc);
  }
  int64_t* tok = token_of.data_ptr<int64_t>();
  float* wout = weight.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t pos = next[ids[r]]++;
    tok[pos] = r / top_k;
    wout[pos] = ws[r];
  }
}

// Every row's token within [0, T): a token_of filled by anything but moe_route must not index past x or out.
static void check_tokens(const int64_t* tok, int64_t R, int64_t T) {
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(tok[r] >= 0 && tok[r] < T, "token_of[", r, "] = ", tok[r], " is not a token of the ", T, " given");
}

static bool float_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16;
}

template <class T>
static void gather_rows(const T* xp, int64_t ldx, const int64_t* tok, int64_t R, int64_t H, T* op) {
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::copy(xp + tok[r] * ldx, xp + tok[r] * ldx + H, op + r * H);
  });
}

void moe_gather_rows(const torch::Tensor& x, const torch::Tensor& token_of, const torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && float_or_bf16(x) && x.stride(1) == 1, "x must be float32 or bfloat16 [T, H]");
  TORCH_CHECK(token_of.scalar_type() == torch::kInt64 && token_of.is_contiguous(), "token_of must be int64 [R]");
  const int64_t R = token_of.numel(), H = x.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == R && out.size(1) == H && out.scalar_type() == x.scalar_type() &&
              out.is_contiguous(), "out must be contiguous [R, H] of x's type");
  const int64_t* tok = token_of.data_ptr<int64_t>();
  check_tokens(tok, R, x.size(0));
  if (x.scalar_type() == torch::kFloat32) {
    gather_rows(x.data_ptr<float>(), x.stride(0), tok, R, H, out.data_ptr<float>());
  } else {
    gather_rows(x.data_ptr<at::BFloat16>(), x.stride(0), tok, R, H, out.data_ptr<at::BFloat16>());
  }
}

// out[t] = (sigmoid(gate[t]) * shared[t] or 0) + sum over rows r of token t of w[r] * y[r], in float32 in row order
// (one thread per range of columns: no races, one result), rounded once to out's type.
template <class T>
static void combine(const T* yp, int64_t ldy, const int64_t* tok, const float* w, int64_t R, int64_t tokens,
                    int64_t H, const T* sp, int64_t lds, const std::vector<float>& gate, T* op) {
  at::parallel_for(0, H, 64, [&](int64_t c0, int64_t c1) {
    const int64_t n = c1 - c0;
    std::vector<float> acc(static_cast<size_t>(tokens * n));
    for (int64_t t = 0; t < tokens; ++t) {
      float* a = acc.data() + t * n;
      if (sp != nullptr) {
        for (int64_t c = c0; c < c1; ++c) a[c - c0] = gate[t] * static_cast<float>(sp[t * lds + c]);
      } else {
        std::fill(a, a + n, 0.f);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      float* dst = acc.data() + tok[r] * n - c0;
      const T* src = yp + r * ldy;
      const float wr = w[r];
      for (int64_t c = c0; c < c1; ++c) dst[c] += static_cast<float>(src[c]) * wr;
    }
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t c = c0; c < c1; ++c) op[t * H + c] = static_cast<T>(acc[t * n + c - c0]);
  });
}

void moe_combine(const torch::Tensor& y, const torch::Tensor& token_of, const torch::Tensor& weight,
                 const torch::Tensor& out, const std::optional<torch::Tensor>& shared,
                 const std::optional<torch::Tensor>& shared_gate) {
  TORCH_CHECK(y.dim() == 2 && float_or_bf16(y) && y.stride(1) == 1, "y must be float32 or bfloat16 [R, H]");
  const int64_t R = y.size(0), H = y.size(1);
  TORCH_CHECK(token_of.scalar_type() == torch::kInt64 && token_of.is_contiguous() && token_of.numel() == R,
              "token_of must be int64 [R]");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == R,
              "weight must be float32 [R] or [R, 1]");
  TORCH_CHECK(out.dim() == 2 && out.size(1) == H && out.scalar_type() == y.scalar_type() && out.is_contiguous(),
              "out must be contiguous [T, H] of y's type");
  const int64_t* tok = token_of.data_ptr<int64_t>();
  const int64_t T = out.size(0);
  check_tokens(tok, R, T);
  const bool has_shared = shared.has_value() && shared->defined();
  TORCH_CHECK(has_shared == (shared_gate.has_value() && shared_gate->defined()),
              "shared and shared_gate come together");
  std::vector<float> gate;  // sigmoid of each token's shared-expert gate logit
  if (has_shared) {
    TORCH_CHECK(shared->dim() == 2 && shared->size(0) == T && shared->size(1) == H &&
                shared->scalar_type() == y.scalar_type() && shared->stride(1) == 1, "shared must be [T, H] of y's type");
    TORCH_CHECK(float_or_bf16(*shared_gate) && shared_gate->numel() == T, "shared_gate must be [T, 1]");
    const torch::Tensor g = shared_gate->to(torch::kFloat32).contiguous();
    gate.resize(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) gate[t] = 1.f / (1.f + std::exp(-g.data_ptr<float>()[t]));
  }
  const float* w = weight.data_ptr<float>();
  const int64_t lds = has_shared ? shared->stride(0) : 0;
  if (y.scalar_type() == torch::kFloat32) {
    combine(y.data_ptr<float>(), y.stride(0), tok, w, R, T, H, has_shared ? shared->data_ptr<float>() : nullptr, lds,
            gate, out.data_ptr<float>());
  } else {
    combine(y.data_ptr<at::BFloat16>(), y.stride(0), tok, w, R, T, H,
            has_shared ? shared->data_ptr<at::BFloat16>() : nullptr, lds, gate, out.data_ptr<at::BFloat16>());
  }
}
