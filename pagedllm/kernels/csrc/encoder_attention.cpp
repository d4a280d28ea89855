// Bidirectional attention for encoder models (BERT and kin): every token attends to every token of its own
// sequence. Sequences are short (an embedding request is a sentence or a paragraph) and a step holds many, so
// torch's SDPA spends more on gathering them into padded, masked batches than on the arithmetic: here q/k/v are read
// in place from the fused qkv projection's output, never padded; each (sequence, KV head)'s K and V are converted to
// float32 once, then a task is one query head and 32 query rows of a sequence. `causal` makes
// each query see only the keys up to its own position (a decoder's prompts, torch_sdpa.py): a sequence's Lq queries
// are the last Lq of its L key positions, so query row i sees keys 0 .. L - Lq + i (Lq = L: a fresh prompt).
//
// Shapes:
//   query [Tq, H, D], key / value [Tk, Hkv, D]  rows may be strided (views into qkv); float32 or bfloat16
//   query_start [R + 1] int32 (host)           token offsets of the R sequences' queries in the flat batch
//   key_start [R + 1] int32 (host)             their keys' offsets in key / value (default: query_start, Tk = Tq)
//   out [Tq, H, D] contiguous, the query's dtype
// This generic kernel's arithmetic is float32 whatever the dtype; its loops are plain C++ that -O3 -march=native
// vectorises. A bf16 query of head dim 32 or 64 may go instead to the bf16 kernels (encoder_attention_bf16.h: AMX
// tiles or AVX-512 BF16 dot products), which take any length: `kernel` picks (encoder_attention_kernels lists them).
#include "bf16_rows.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t KP = 16;  // keys (and value columns) per register block: one AVX-512 register of float32
// Query rows per register block: RB x KP accumulators, 8 independent FMA chains on AVX-512 (32 registers),
// 4 x 2 on AVX2 (16 registers).
#if defined(__AVX512F__)
constexpr int64_t RB = 8;
#else
constexpr int64_t RB = 4;
#endif
// Softmax arguments are clamped here: libmvec's vector expf sends lanes below ~-87 (and -inf) through a
// scalar slow path, which padded keys hit on every row. exp(-87) ~ 1.6e-38: nothing a sum of ones notices.
constexpr float MIN_EXP_ARG = -87.f;

constexpr float PAD_SCORE = -1e30f;  // finite: -inf - -inf would be NaN in an all-padding block

// max of s[0, n) for n a multiple of KP, in KP lanes (the compiler left a plain max reduction scalar).
inline float row_max(const float* s, int64_t n) {
  float m[KP];
  for (int c = 0; c < KP; ++c) m[c] = PAD_SCORE;
  for (int64_t j0 = 0; j0 < n; j0 += KP)
    for (int c = 0; c < KP; ++c) m[c] = s[j0 + c] > m[c] ? s[j0 + c] : m[c];
  float r = m[0];
  for (int c = 1; c < KP; ++c) r = m[c] > r ? m[c] : r;
  return r;
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// One register-blocked small matmul serves both products: Q K^T (a = the scaled queries [RB, D], b = K^T [D, Lp])
// and P V (a = the probabilities [RB, n], b = V [n, Dp]). With fixed trip counts the RB x KP accumulators stay in
// registers (a loop over a runtime length that updates a row of scores in memory chains every step through a store
// and a reload instead, which made this kernel as slow as the padded SDPA it replaces).
//   out[r, c] = sum_i a[r * a_row + i] * b[i * b_row + c]   for RB rows, KP columns and i < n
#if defined(__AVX512F__)
// Intrinsics, one 16-lane register per row: GCC's tuning for some AVX-512 CPUs (Intel's) prefers 256-bit vectors
// for loops it vectorises itself, which would halve them there.
static_assert(KP == 16 && RB == 8, "one register of columns per row");

inline void block_product(const float* a, int64_t a_row, const float* b, int64_t b_row, int64_t n, float* out,
                          int64_t out_row) {
  __m512 acc[RB];
  for (auto& x : acc) x = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m512 bi = _mm512_loadu_ps(b + i * b_row);
    for (int r = 0; r < RB; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * a_row + i]), bi, acc[r]);
  }
  for (int r = 0; r < RB; ++r) _mm512_storeu_ps(out + r * out_row, acc[r]);
}
#else
inline void block_product(const float* a, int64_t a_row, const float* b, int64_t b_row, int64_t n, float* out,
                          int64_t out_row) {
  float acc[RB][KP] = {};
  for (int64_t i = 0; i < n; ++i) {
    const float* bi = b + i * b_row;
    for (int r = 0; r < RB; ++r) {
      const float ai = a[r * a_row + i];
#pragma omp simd
      for (int c = 0; c < KP; ++c) acc[r][c] += ai * bi[c];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KP; ++c) out[r * out_row + c] = acc[r][c];
}
#endif

// Query rows per task: a task is one query head and QB rows of one sequence, so that one long sequence still
// spreads over every thread (as one task per (sequence, KV head), a 2,048-token prompt with 3 KV heads kept one of
// two threads idle a third of the time).
constexpr int64_t QB = 32;
static_assert(QB % RB == 0, "row blocks must tile a task's rows");

template <typename T>
void run(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& out,
         const int32_t* qs, const int32_t* ks, int64_t num_seqs, float scale, bool causal) {
  const int64_t H = query.size(1), D = query.size(2), Hkv = key.size(1);
  const int64_t group = H / Hkv;
  const int64_t Dp = round_up(D, KP);
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = key.data_ptr<T>();
  const T* v_ptr = value.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t q_row = query.stride(0), k_row = key.stride(0), v_row = value.stride(0);
  // Pass 1: float32 copies of every (sequence, KV head)'s K^T [D, Lp] and V [Lp, Dp], zero-padded, shared by the
  // tasks of its query heads. Kept between calls, as large as the largest call so far (a fresh buffer would fault
  // its pages in every call).
  std::vector<int64_t> packed_at(num_seqs * Hkv + 1, 0);
  int64_t max_lp = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t Lp = round_up(ks[i + 1] - ks[i], KP);
    max_lp = std::max(max_lp, Lp);
    for (int64_t hk = 0; hk < Hkv; ++hk) packed_at[i * Hkv + hk + 1] = packed_at[i * Hkv + hk] + Lp * (D + Dp);
  }
  thread_local std::vector<float> packed_buf;
  if (packed_buf.size() < static_cast<size_t>(packed_at.back())) packed_buf.resize(packed_at.back());
  float* packed = packed_buf.data();
  at::parallel_for(0, num_seqs * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> krow;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t seq = t / Hkv, hk = t % Hkv, k_start = ks[seq], L = ks[seq + 1] - k_start;
      const int64_t Lp = round_up(L, KP);
      float* kt = packed + packed_at[t];
      float* v = kt + D * Lp;
      krow.resize(static_cast<size_t>(L * D));
      // Convert row by row (contiguous, vectorised), then transpose K in float32.
      for (int64_t j = 0; j < L; ++j) {
        load_row(krow.data() + j * D, k_ptr + (k_start + j) * k_row + hk * D, D);
        load_row(v + j * Dp, v_ptr + (k_start + j) * v_row + hk * D, D);
        std::fill(v + j * Dp + D, v + (j + 1) * Dp, 0.f);
      }
      std::fill(v + L * Dp, v + Lp * Dp, 0.f);
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t j = 0; j < L; ++j) kt[d * Lp + j] = krow[j * D + d];
        std::fill(kt + d * Lp + L, kt + (d + 1) * Lp, 0.f);
      }
    }
  });
  // Pass 2: tasks (sequence, query head, block of QB rows).
  struct Task {
    int64_t seq, h, i0;
  };
  std::vector<Task> tasks;
  for (int64_t i = 0; i < num_seqs; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i0 = 0; i0 < qs[i + 1] - qs[i]; i0 += QB) tasks.push_back({i, h, i0});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    // Per block of RB query rows: Q [RB, D], scores [RB, up to Lp] and out [RB, Dp].
    std::vector<float> q(static_cast<size_t>(RB * D)), s(static_cast<size_t>(RB * max_lp));
    std::vector<float> o(static_cast<size_t>(RB * Dp));
    float inv_sum[RB];
    for (int64_t ti = t0; ti < t1; ++ti) {
      const Task& task = tasks[ti];
      const int64_t seq = task.seq, h = task.h, start = qs[seq], Lq = qs[seq + 1] - start;
      const int64_t L = ks[seq + 1] - ks[seq], Lp = round_up(L, KP);
      const int64_t context = L - Lq;  // causal: keys before the first query's position
      const float* kt = packed + packed_at[seq * Hkv + h / group];
      const float* v = kt + D * Lp;
      for (int64_t i0 = task.i0; i0 < std::min(Lq, task.i0 + QB); i0 += RB) {
        const int64_t rows = std::min(RB, Lq - i0);
        // Keys this block of rows attends: causal, those up to its last row's position (the rest weigh 0).
        const int64_t n = causal ? context + i0 + rows : L, np = round_up(n, KP);
        std::fill(q.begin(), q.end(), 0.f);  // rows past Lq stay zero
        for (int64_t r = 0; r < rows; ++r) {
          float* qr = q.data() + r * D;
          load_row(qr, q_ptr + (start + i0 + r) * q_row + h * D, D);
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) qr[d] *= scale;
        }
        for (int64_t j0 = 0; j0 < np; j0 += KP) block_product(q.data(), D, kt + j0, Lp, D, s.data() + j0, np);
        // Softmax numerators per row; the normalisation is applied to the output.
        for (int64_t r = 0; r < RB; ++r) {
          float* sp = s.data() + r * np;
          if (r >= rows) {  // rows past Lq: zero weights, their output is never stored
            std::fill(sp, sp + np, 0.f);
            continue;
          }
          // Padded keys (and, causal, the keys after the row's own position): weight exp(MIN_EXP_ARG) ~ 0.
          for (int64_t j = causal ? context + i0 + r + 1 : L; j < np; ++j) sp[j] = PAD_SCORE;
          const float max_s = row_max(sp, np);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < np; ++j) {
            sp[j] = expf(std::max(sp[j] - max_s, MIN_EXP_ARG));
            sum += sp[j];
          }
          inv_sum[r] = 1.f / sum;
        }
        for (int64_t c0 = 0; c0 < Dp; c0 += KP) block_product(s.data(), np, v + c0, Dp, n, o.data() + c0, Dp);
        for (int64_t r = 0; r < rows; ++r)
          store_row(o_ptr + ((start + i0 + r) * H + h) * D, o.data() + r * Dp, inv_sum[r], D);
      }
    }
  });
}

}  // namespace

std::vector<std::string> encoder_attention_kernels(const torch::Tensor& query, bool causal) {
  std::vector<std::string> names;
  if (!causal && encoder_attention_amx_takes(query)) names.emplace_back("amx");
  if (encoder_attention_avx512bf16_takes(query)) names.emplace_back("avx512_bf16");
  if (query.scalar_type() == torch::kFloat32 || query.scalar_type() == torch::kBFloat16) names.emplace_back("generic");
  return names;
}

torch::Tensor encoder_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                const torch::Tensor& query_start, double scale, const std::string& kernel,
                                bool causal, const c10::optional<torch::Tensor>& key_start) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "query/key/value must be [T, heads, D]");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "query, key and value must share a dtype");
  TORCH_CHECK((key_start.has_value() || query.size(0) == key.size(0)) && key.sizes() == value.sizes() &&
              query.size(2) == key.size(2), "query [T, H, D] and key/value [T, Hkv, D] do not match");
  TORCH_CHECK(key.size(1) > 0 && query.size(1) % key.size(1) == 0, "query heads must be a multiple of KV heads");
  for (const torch::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "heads must be contiguous within each token row");
  const auto offsets = [](const torch::Tensor& t, const char* name, int64_t rows) {
    TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.is_contiguous() && t.dim() == 1 && t.device().is_cpu(), name,
                " must be a contiguous int32 CPU tensor [R + 1]");
    const int64_t n = t.size(0) - 1;
    const int32_t* o = t.data_ptr<int32_t>();
    TORCH_CHECK(n >= 0 && (n == 0 || (o[0] >= 0 && o[n] <= rows)), name, " is out of range of the batch");
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(o[i] <= o[i + 1], name, " must be non-decreasing");
    return o;
  };
  const int64_t num_seqs = query_start.size(0) - 1;
  const int32_t* qs = offsets(query_start, "query_start", query.size(0));
  const int32_t* ks = qs;
  if (key_start.has_value()) {
    TORCH_CHECK(key_start->size(0) == query_start.size(0), "key_start and query_start must list the same sequences");
    ks = offsets(*key_start, "key_start", key.size(0));
    for (int64_t i = 0; i < num_seqs; ++i) {
      const int64_t queries = qs[i + 1] - qs[i], keys = ks[i + 1] - ks[i];
      TORCH_CHECK(!causal || queries <= keys, "causal: sequence ", i, " has more queries than keys");
      TORCH_CHECK(queries == 0 || keys > 0, "sequence ", i, " has queries but no keys");
    }
  }
  torch::Tensor out = torch::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  const float fscale = static_cast<float>(scale);
  const std::vector<std::string> able = encoder_attention_kernels(query, causal);
  TORCH_CHECK(kernel == "auto" || std::find(able.begin(), able.end(), kernel) != able.end(), "encoder_attention: ",
              "kernel '", kernel, "' cannot run this query here (", query.scalar_type(), ", head dim ", query.size(2),
              causal ? ", causal" : "", "); this CPU can run: ", c10::Join(", ", able));
  const std::string& chosen = kernel == "auto" && !able.empty() ? able.front() : kernel;
  if (chosen == "amx") {
    encoder_attention_amx(query, key, value, out, qs, ks, num_seqs, fscale);
    return out;
  }
  if (chosen == "avx512_bf16") {
    encoder_attention_avx512bf16(query, key, value, out, qs, ks, num_seqs, fscale, causal);
    return out;
  }
  if (query.scalar_type() == torch::kFloat32) {
    run<float>(query, key, value, out, qs, ks, num_seqs, fscale, causal);
  } else if (query.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(query, key, value, out, qs, ks, num_seqs, fscale, causal);
  } else {
    TORCH_CHECK(false, "encoder_attention: dtype must be float32 or bfloat16");
  }
  return out;
}
