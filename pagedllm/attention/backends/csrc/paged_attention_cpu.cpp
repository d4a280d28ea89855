// Paged attention for CPUs: every query token reads its context straight from the block-structured
// KV cache (no gather into a padded copy), with one (request, kv head) pair per task.
//
// Shapes:
//   query        [T, H, D]                 T flat query tokens of R requests
//   key_cache    [num_blocks, block_size, Hkv, D]   (value_cache the same)
//   block_tables [R, max_blocks] int32
//   seq_lens     [R] int32                 context length after this step (includes the new tokens)
//   query_start  [R + 1] int32             offsets of each request's tokens in the flat batch
//   out          [T, H, D]
// Query token j of request r sits at position seq_len - q_len + j and attends keys 0..that position.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift.
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

// Rows ahead to prefetch: K/V rows of one head are strided, so the hardware prefetcher needs help.
constexpr int64_t kPrefetch = 4;

template <typename KV>
inline void prefetch_row(const KV* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(KV)); off += 64) __builtin_prefetch(p + off);
}

// s[g] = dot(q + g * D, row) for the G query heads of one KV head.
template <typename KV>
inline void dots(const float* q, const KV* row, int64_t G, int64_t D, float* s) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0 && G <= 8) {
    __m256 acc[8];
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k = load8(row + d);
      for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), k, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) s[g] = hsum(acc[g]);
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    float t = 0.f;
    for (int64_t d = 0; d < D; ++d) t += q[g * D + d] * to_float(row[d]);
    s[g] = t;
  }
}

// acc[g] += p[g] * row for the G query heads.
template <typename KV>
inline void axpys(const float* p, const KV* row, int64_t G, int64_t D, float* acc) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 v = load8(row + d);
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc + g * D + d;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(p[g]), v, _mm256_loadu_ps(a)));
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p[g] * to_float(row[d]);
}

template <typename KV>
void run(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, const torch::Tensor& query_start,
         torch::Tensor& out, double scale, const torch::Tensor& req_indices) {
  const int64_t num_tasks = req_indices.size(0);
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t G = H / Hkv;
  TORCH_CHECK(G <= 64, "at most 64 query heads per KV head");
  const int64_t max_blocks = block_tables.size(1);
  const float* q_ptr = query.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const KV* k_ptr = key_cache.data_ptr<KV>();
  const KV* v_ptr = value_cache.data_ptr<KV>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* ri = req_indices.data_ptr<int32_t>();
  const int64_t tok_stride = Hkv * D;           // between tokens inside a block
  const int64_t blk_stride = block_size * tok_stride;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_tasks * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = ri[task / Hkv], kvh = task % Hkv;
      const int64_t seq_len = sl[r];
      const int64_t q_begin = qs[r], q_len = qs[r + 1] - qs[r];
      const int32_t* table = bt + r * max_blocks;
      scores.resize(static_cast<size_t>(G * seq_len));
      for (int64_t j = 0; j < q_len; ++j) {
        const int64_t ctx = seq_len - q_len + j + 1;  // keys visible to this query token
        // The G query heads sharing this KV head: each K/V row is read once for all of them.
        const float* q = q_ptr + ((q_begin + j) * H + kvh * G) * D;
        float sg_buf[64];
        for (int64_t t = 0; t < ctx; ++t) {
          const KV* k = k_ptr + table[t / block_size] * blk_stride + (t % block_size) * tok_stride + kvh * D;
          if (t + kPrefetch < ctx) {
            const int64_t u = t + kPrefetch;
            prefetch_row(k_ptr + table[u / block_size] * blk_stride + (u % block_size) * tok_stride + kvh * D, D);
          }
          dots(q, k, G, D, sg_buf);
          for (int64_t g = 0; g < G; ++g) scores[g * ctx + t] = sg_buf[g] * fscale;
        }
        std::vector<float> inv_sum(G);
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + g * ctx;
          float max_s = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max_s)
          for (int64_t t = 0; t < ctx; ++t) max_s = std::max(max_s, sg[t]);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < ctx; ++t) {
            sg[t] = expf(sg[t] - max_s);  // vectorized by libmvec under -ffast-math
            sum += sg[t];
          }
          inv_sum[g] = 1.f / sum;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        float p_buf[64];
        for (int64_t t = 0; t < ctx; ++t) {
          const KV* v = v_ptr + table[t / block_size] * blk_stride + (t % block_size) * tok_stride + kvh * D;
          if (t + kPrefetch < ctx) {
            const int64_t u = t + kPrefetch;
            prefetch_row(v_ptr + table[u / block_size] * blk_stride + (u % block_size) * tok_stride + kvh * D, D);
          }
          for (int64_t g = 0; g < G; ++g) p_buf[g] = scores[g * ctx + t];
          axpys(p_buf, v, G, D, acc.data());
        }
        for (int64_t g = 0; g < G; ++g) {
          float* o = o_ptr + ((q_begin + j) * H + kvh * G + g) * D;
          const float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv_sum[g];
        }
      }
    }
  });
}

}  // namespace

// Attention for the requests listed in req_indices [n] int32; query/out float32, the cache float32 or bf16.
void paged_attention(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                     const torch::Tensor& query_start, torch::Tensor& out, double scale,
                     const torch::Tensor& req_indices) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "query/out must be float32");
  TORCH_CHECK(req_indices.scalar_type() == torch::kInt32 && block_tables.scalar_type() == torch::kInt32 &&
              seq_lens.scalar_type() == torch::kInt32 && query_start.scalar_type() == torch::kInt32,
              "index tensors must be int32");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() &&
              value_cache.is_contiguous() && block_tables.is_contiguous(), "inputs must be contiguous");
  if (key_cache.scalar_type() == torch::kFloat32) {
    run<float>(query, key_cache, value_cache, block_tables, seq_lens, query_start, out, scale, req_indices);
  } else if (key_cache.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(query, key_cache, value_cache, block_tables, seq_lens, query_start, out, scale, req_indices);
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32 or bfloat16");
  }
}

// Store this step's K/V: key/value [T, Hkv, D] into caches [num_blocks * block_size, Hkv, D] at slot_mapping [T].
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
              torch::Tensor& value_cache, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "K/V dtype must match the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const torch::Tensor k = key.contiguous(), v = value.contiguous();
  const int64_t T = k.size(0);
  const int64_t row_bytes = k.numel() / std::max<int64_t>(T, 1) * k.element_size();
  const int64_t num_slots = key_cache.numel() * key_cache.element_size() / std::max<int64_t>(row_bytes, 1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kd = static_cast<char*>(key_cache.data_ptr());
  char* vd = static_cast<char*>(value_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kd + slots[t] * row_bytes, ks + t * row_bytes, row_bytes);
      std::memcpy(vd + slots[t] * row_bytes, vs + t * row_bytes, row_bytes);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "Store K/V rows at their cache slots (CPU)");
  m.def("paged_attention", &paged_attention, "Paged attention reading K/V through block tables (CPU)");
}
