// Paged attention for CPUs: every query token reads its context straight from the block-structured
// KV cache (no gather into a padded copy). A task is one request (or one of its KV heads when there are
// few requests); within it scores are computed block by block, then softmax, then the V rows are summed.
//
// Shapes:
//   query        [T, H, D]                 T flat query tokens of R requests (rows may be strided)
//   key_cache    [num_blocks, block_size, Hkv, D]   (value_cache the same): float32, bf16 or fp8 (e4m3 / e5m2,
//                                                    read in registers and multiplied by the layer's kv_scale)
//   block_tables [R, max_blocks] int32
//   seq_lens     [R] int32                 context length after this step (includes the new tokens)
//   query_start  [R + 1] int32             offsets of each request's tokens in the flat batch
//   out          [T, H, D]
// Query token j of request r sits at position seq_len - q_len + j and attends keys 0..that position.
#include "attention_bf16.h"
#include "bf16_rows.h"
#include "fp8_rows.h"
#include "head_tiles.h"
#include "kernels.h"
#include "row_max.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// Builds for AVX-512 (-march=native on such a CPU) score and sum with 16-lane vectors, others with AVX2's 8.

namespace {

constexpr int64_t QUERY_ROWS_PER_TASK = 32;
// Keys per partition of a long context (see run).
constexpr int64_t PARTITION_KEYS = 256;
// Rows of a block scored or summed between two calls of the next task's prefetch (TaskPrefetch::issue), whatever
// the block size: with one call per block, a 64-token block issued ~130 prefetches at once, and a 200-request bf16
// decode layer took 1.45 ms with K/V in L3 against 0.88 for 16-token blocks (AMD Zen 4). A multiple of 16, so that
// AMX score tiles and bf16 key pairs stay whole.
constexpr int64_t PREFETCH_ROWS = 16;

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
inline __m256 fold(__m512 a) {  // lanes i and i + 8 added
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
// The totals of four 16-lane partial sums, in lanes 0..3.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(fold(a), fold(b)), _mm256_hadd_ps(fold(c), fold(d)));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// acc[g, d0 .. d0 + 16 CH) += sum_i p[g * stride + i] * rows[i, same columns]: all GT x CH outputs in registers.
template <int GT, int CH, typename KV>
inline void accumulate_chunks(const float* p, int64_t stride, const KV* rows, int64_t row_stride, int64_t n,
                              int64_t D, int64_t d0, float* acc) {
  __m512 a[GT][CH];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < CH; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + d0 + 16 * c);
  for (int64_t i = 0; i < n; ++i) {
    const KV* row = rows + i * row_stride + d0;
    __m512 v[CH];
    for (int c = 0; c < CH; ++c) v[c] = load16(row + 16 * c);
    for (int g = 0; g < GT; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * stride + i]);
      for (int c = 0; c < CH; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + g * D + d0 + 16 * c, a[g][c]);
}
#endif

// One line into L2. Inline asm rather than __builtin_prefetch: GCC 12 deletes a loop nest whose only statements
// are __builtin_prefetch calls (every prefetch of the task prefetch loop was gone from the build). On AMD Zen 4,
// with the prefetches still issued a block at a time, prefetcht0 (into L1) ran 1.4x slower and prefetchnta 1.5x.
inline void prefetch_into_l2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" ::"m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Prefetches into L2 the K and V rows of a thread's next task (blocks b_begin .. b_end of its block table: all K rows,
// then all V rows, in the order that task reads them), a few token rows at each `issue` while the current task
// computes, the rest at `finish`. The rows must be spread evenly over the whole task: issued a block (~200 cache
// lines) at a time, they filled the core's outstanding-miss slots in bursts that held up the compute, and the memory
// idled while the kernel computed. A decode layer over 200 requests (~192 tokens each, bf16 K/V in 16-token blocks in
// random order, AMD Zen 4, 2 threads) took 1.8-1.9 ms with a block per issue (16 GB/s of K/V on a machine that reads
// 24 GB/s on one core and 33 on two; the compute alone, K/V in cache, takes ~0.7 ms), 1.1-1.35 ms spread.
// A task of one KV head prefetches only that head's rows (whole blocks, for each of 8 heads, made a 1-query
// cross-attention over 1,500 positions 4x slower). The current task then reads its rows from L2: prefetching each
// next block into L1 as well cost more than it saved (single decodes 10-25% slower, 200 decodes the same).
template <typename KV>
struct TaskPrefetch {
  int64_t blk_stride = 0, row_stride = 0, n = 0, row_elems = 0;  // the cache's layout and a task's share of a row

  // Spread the rows of blocks b_begin .. b_end of `tbl` (K rows of k, then V rows of v) over `issues` calls of
  // `issue`.
  void start(const KV* k, const KV* v, const int32_t* tbl, int64_t b_begin, int64_t b_stop, int64_t issues) {
    cache[0] = k, cache[1] = v, table = tbl, first = b_begin, b_end = b_stop;
    pass = b_begin < b_stop ? 0 : 2, b = b_begin, row = 0;
    per_issue = 2 * (b_stop - b_begin) * n / std::max<int64_t>(issues, 1) + 1;  // done a little before the task ends
  }
  void issue() { run(per_issue); }
  void finish() { run(std::numeric_limits<int64_t>::max()); }

 private:
  const KV* cache[2] = {nullptr, nullptr};
  const int32_t* table = nullptr;
  int64_t first = 0, b_end = 0, per_issue = 0;
  int64_t pass = 2, b = 0, row = 0;  // the next row: of K (0) or V (1), block, row in it; pass 2: all issued

  void run(int64_t rows) {
    const int64_t row_bytes = row_elems * static_cast<int64_t>(sizeof(KV));
    while (rows > 0 && pass < 2) {
      const KV* r = cache[pass] + table[b] * blk_stride + row * row_stride;
      const int64_t take = std::min(rows, n - row);
      for (int64_t t = 0; t < take; ++t, r += row_stride)
        for (int64_t off = 0; off < row_bytes; off += 64) prefetch_into_l2(reinterpret_cast<const char*>(r) + off);
      rows -= take, row += take;
      if (row < n) return;
      row = 0;
      if (++b < b_end) continue;
      b = first, ++pass;
    }
  }
};

// scores[g * stride + i] = scale * dot(q_g, rows[i]) for GT query heads and n rows (rows `row_stride` apart).
template <int GT, typename KV>
inline void score_rows(const float* q, int64_t D, const KV* rows, int64_t row_stride, int64_t n, float scale,
                       float* scores, int64_t stride) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    // 4 keys x GT heads of 16-lane partial sums in registers; one reduction tree per 4 keys and head.
    for (; i + 4 <= n; i += 4) {
      __m512 acc[GT][4];
      for (int g = 0; g < GT; ++g)
        for (int k = 0; k < 4; ++k) acc[g][k] = _mm512_setzero_ps();
      const KV* r0 = rows + i * row_stride;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 k0 = load16(r0 + d), k1 = load16(r0 + row_stride + d);
        const __m512 k2 = load16(r0 + 2 * row_stride + d), k3 = load16(r0 + 3 * row_stride + d);
        for (int g = 0; g < GT; ++g) {
          const __m512 qv = _mm512_loadu_ps(q + g * D + d);
          acc[g][0] = _mm512_fmadd_ps(qv, k0, acc[g][0]);
          acc[g][1] = _mm512_fmadd_ps(qv, k1, acc[g][1]);
          acc[g][2] = _mm512_fmadd_ps(qv, k2, acc[g][2]);
          acc[g][3] = _mm512_fmadd_ps(qv, k3, acc[g][3]);
        }
      }
      for (int g = 0; g < GT; ++g)
        _mm_storeu_ps(scores + g * stride + i,
                      _mm_mul_ps(sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    // 4 keys x GT heads of partial sums stay in registers; one horizontal reduction per 4 keys.
    for (; i + 4 <= n; i += 4) {
      __m256 acc[GT][4];
      for (int g = 0; g < GT; ++g)
        for (int k = 0; k < 4; ++k) acc[g][k] = _mm256_setzero_ps();
      const KV* r0 = rows + i * row_stride;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 k0 = load8(r0 + d), k1 = load8(r0 + row_stride + d);
        const __m256 k2 = load8(r0 + 2 * row_stride + d), k3 = load8(r0 + 3 * row_stride + d);
        for (int g = 0; g < GT; ++g) {
          const __m256 qv = _mm256_loadu_ps(q + g * D + d);
          acc[g][0] = _mm256_fmadd_ps(qv, k0, acc[g][0]);
          acc[g][1] = _mm256_fmadd_ps(qv, k1, acc[g][1]);
          acc[g][2] = _mm256_fmadd_ps(qv, k2, acc[g][2]);
          acc[g][3] = _mm256_fmadd_ps(qv, k3, acc[g][3]);
        }
      }
      for (int g = 0; g < GT; ++g) {
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        _mm_storeu_ps(scores + g * stride + i, _mm_mul_ps(r, _mm_set1_ps(scale)));
      }
    }
  }
#endif
  for (; i < n; ++i) {
    const KV* row = rows + i * row_stride;
    for (int g = 0; g < GT; ++g) {
      float t = 0.f;
      for (int64_t d = 0; d < D; ++d) t += q[g * D + d] * to_float(row[d]);
      scores[g * stride + i] = t * scale;
    }
  }
}

// acc[g] += sum_i p[g * stride + i] * rows[i] for GT query heads (acc is [GT, D]).
template <int GT, typename KV>
inline void accumulate_rows(const float* p, int64_t stride, const KV* rows, int64_t row_stride, int64_t n,
                            int64_t D, float* acc) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  // up to 4 x 16 columns per sweep over the rows
      switch (std::min<int64_t>(4, (D - d0) / 16)) {
        case 4: accumulate_chunks<GT, 4>(p, stride, rows, row_stride, n, D, d0, acc); break;
        case 3: accumulate_chunks<GT, 3>(p, stride, rows, row_stride, n, D, d0, acc); break;
        case 2: accumulate_chunks<GT, 2>(p, stride, rows, row_stride, n, D, d0, acc); break;
        default: accumulate_chunks<GT, 1>(p, stride, rows, row_stride, n, D, d0, acc); break;
      }
    }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 16 == 0) {
    // 16 columns x GT heads of output stay in registers across all n rows.
    for (int64_t d = 0; d < D; d += 16) {
      __m256 a[GT][2];
      for (int g = 0; g < GT; ++g) {
        a[g][0] = _mm256_loadu_ps(acc + g * D + d);
        a[g][1] = _mm256_loadu_ps(acc + g * D + d + 8);
      }
      for (int64_t i = 0; i < n; ++i) {
        const KV* row = rows + i * row_stride + d;
        const __m256 v0 = load8(row), v1 = load8(row + 8);
        for (int g = 0; g < GT; ++g) {
          const __m256 w = _mm256_broadcast_ss(p + g * stride + i);
          a[g][0] = _mm256_fmadd_ps(w, v0, a[g][0]);
          a[g][1] = _mm256_fmadd_ps(w, v1, a[g][1]);
        }
      }
      for (int g = 0; g < GT; ++g) {
        _mm256_storeu_ps(acc + g * D + d, a[g][0]);
        _mm256_storeu_ps(acc + g * D + d + 8, a[g][1]);
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const KV* row = rows + i * row_stride;
    for (int g = 0; g < GT; ++g)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p[g * stride + i] * to_float(row[d]);
  }
}

#if defined(__AVX512BF16__)
// score_rows for a bf16 query against a bf16 cache (D a multiple of 32): vdpbf16ps sums pairs of bf16 products into
// float lanes, so neither side is widened: half the instructions of the float path per key.
template <int GT>
inline void score_rows_bf16(const at::BFloat16* q, int64_t D, const at::BFloat16* rows, int64_t row_stride,
                            int64_t n, float scale, float* scores, int64_t stride) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m512 acc[GT][4];
    for (int g = 0; g < GT; ++g)
      for (int k = 0; k < 4; ++k) acc[g][k] = _mm512_setzero_ps();
    const at::BFloat16* r0 = rows + i * row_stride;
    for (int64_t d = 0; d < D; d += 32) {
      __m512bh kv[4];
      for (int k = 0; k < 4; ++k) kv[k] = (__m512bh)_mm512_loadu_si512(r0 + k * row_stride + d);
      for (int g = 0; g < GT; ++g) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + g * D + d);
        for (int k = 0; k < 4; ++k) acc[g][k] = _mm512_dpbf16_ps(acc[g][k], qv, kv[k]);
      }
    }
    for (int g = 0; g < GT; ++g)
      _mm_storeu_ps(scores + g * stride + i,
                    _mm_mul_ps(sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale)));
  }
  for (; i < n; ++i) {
    const at::BFloat16* row = rows + i * row_stride;
    for (int g = 0; g < GT; ++g) {
      float t = 0.f;
      for (int64_t d = 0; d < D; ++d) t += static_cast<float>(q[g * D + d]) * static_cast<float>(row[d]);
      scores[g * stride + i] = t * scale;
    }
  }
}

inline void score_heads_bf16(const at::BFloat16* q, int64_t G, int64_t D, const at::BFloat16* rows,
                             int64_t row_stride, int64_t n, float scale, float* scores, int64_t stride) {
  head_tiles::for_each(G, [&](auto T, int64_t g0) PAGEDLLM_INLINE_TILE {
    score_rows_bf16<decltype(T)::value>(q + g0 * D, D, rows, row_stride, n, scale, scores + g0 * stride, stride);
  });
}
#endif

// Over the query-head tiles (head_tiles.h).
template <typename KV>
inline void score_heads(const float* q, int64_t G, int64_t D, const KV* rows, int64_t row_stride, int64_t n,
                        float scale, float* scores, int64_t stride) {
  head_tiles::for_each(G, [&](auto T, int64_t g0) PAGEDLLM_INLINE_TILE {
    score_rows<decltype(T)::value>(q + g0 * D, D, rows, row_stride, n, scale, scores + g0 * stride, stride);
  });
}

template <typename KV>
inline void accumulate_heads(const float* p, int64_t stride, int64_t G, const KV* rows, int64_t row_stride,
                             int64_t n, int64_t D, float* acc) {
  head_tiles::for_each(G, [&](auto T, int64_t g0) PAGEDLLM_INLINE_TILE {
    accumulate_rows<decltype(T)::value>(p + g0 * stride, stride, rows, row_stride, n, D, acc + g0 * D);
  });
}

// k_mul / v_mul: what a load of a K / V element is multiplied by to give its value (an fp8 cache's scale times
// kv_unit; 1 otherwise), folded into the scores' scale and the output's normalisation.
template <typename KV, typename Q>
void run(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, const torch::Tensor& query_start,
         torch::Tensor& out, double scale, const torch::Tensor& req_indices, bool allow_amx, float k_mul = 1.f,
         float v_mul = 1.f) {
  const int64_t num_reqs = req_indices.size(0);
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t G = H / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const Q* q_ptr = query.data_ptr<Q>();
  const int64_t q_row = query.stride(0);  // q may be a slice of the fused qkv output
  Q* o_ptr = out.data_ptr<Q>();
  const KV* k_ptr = static_cast<const KV*>(key_cache.data_ptr());
  const KV* v_ptr = static_cast<const KV*>(value_cache.data_ptr());
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* ri = req_indices.data_ptr<int32_t>();
  const int64_t tok_stride = Hkv * D;  // between tokens inside a block
  const int64_t blk_stride = block_size * tok_stride;
  const float fscale = static_cast<float>(scale) * k_mul;
  // bf16 query and cache on a CPU with AVX512-BF16 (a build for it): scores by bf16 dot products.
#if defined(__AVX512BF16__)
  const bool bf16_dots = std::is_same_v<Q, at::BFloat16> && std::is_same_v<KV, at::BFloat16> && D % 32 == 0;
#else
  const bool bf16_dots = false;
#endif
  // bf16 dot products: scores on AMX tiles where granted (whole 16-row tiles must lie inside a block), and the V
  // sums over pairs of keys (a pair never straddles two blocks).
  const bool amx_scores = bf16_dots && allow_amx && block_size % attention_bf16::TILE_KEYS == 0 && G <= 16 &&
                          amx_tiles::bf16_supported();
  const bool pair_sums = bf16_dots && block_size % 2 == 0;
  // With many requests a task is one request and all its KV heads, so a block (all heads' rows,
  // contiguous) is streamed once; with few requests, split by KV head to keep every thread busy.
  const int64_t heads_per_task = num_reqs >= 4 * at::get_num_threads() ? Hkv : 1;
  const int64_t tasks_per_req = Hkv / heads_per_task;
  const int64_t task_elems = heads_per_task * D;  // of each token row in a block
  const int64_t chunks_per_block = (block_size + PREFETCH_ROWS - 1) / PREFETCH_ROWS;  // issue points a block

  // Tasks differ in cost by orders of magnitude (a 1-token decode next to a whole prompt), so instead of
  // a static split the threads pull tasks from a shared counter, longest first (cost ~ rows x keys). A long
  // query (a prompt chunk) is cut into tasks of QUERY_ROWS_PER_TASK tokens: its tokens attend independently, and
  // as one task a 952-token chunk over 3,000 tokens of context kept one thread busy for a whole step.
  // A context longer than PARTITION_KEYS keys is cut into partitions of that many, attended as tasks of their own
  // and combined afterwards by their softmax maxima and sums (flash-decoding): one decode over 3 KV heads on 2
  // threads otherwise leaves a thread idle a third of the time. The cut depends only on the request's context, never
  // on the batch, so a request's output is the same alone or batched; a context of at most PARTITION_KEYS keys is one
  // partition, attended as a whole.
  struct Task {
    int64_t idx, h_begin, j_begin, j_end, part, cost;
  };
  // Few query rows in all (one request verifying 4 drafts: 5 rows, 3 KV heads) are cut finer, so that every
  // thread gets work: three 5-row tasks on two threads left one thread idle half the time.
  int64_t total_rows = 0;
  for (int64_t i = 0; i < num_reqs; ++i) total_rows += qs[ri[i] + 1] - qs[ri[i]];
  const int64_t wanted_tasks = 4 * at::get_num_threads();
  const int64_t rows_per_task = std::clamp<int64_t>(total_rows * tasks_per_req / wanted_tasks, 1, QUERY_ROWS_PER_TASK);
  const int64_t part_blocks = std::max<int64_t>(1, PARTITION_KEYS / block_size);
  // Per listed request: its partitions, and where its rows' partial results start (split requests only).
  std::vector<int64_t> parts(static_cast<size_t>(num_reqs)), partial_base(static_cast<size_t>(num_reqs), 0);
  int64_t num_partials = 0;  // (row, partition) pairs of split requests
  std::vector<Task> tasks;
  tasks.reserve(static_cast<size_t>(num_reqs * tasks_per_req));
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t r = ri[i], q_len = qs[r + 1] - qs[r], seq_len = sl[r];
    const int64_t np = ((seq_len + block_size - 1) / block_size + part_blocks - 1) / part_blocks;
    parts[i] = np;
    if (np > 1) {
      partial_base[i] = num_partials;
      num_partials += q_len * np;
    }
    for (int64_t j0 = 0; j0 < q_len; j0 += rows_per_task) {
      const int64_t j1 = std::min(q_len, j0 + rows_per_task);
      for (int64_t p = 0; p < np; ++p) {
        const int64_t keys = std::min(part_blocks * block_size, seq_len - p * part_blocks * block_size);
        for (int64_t t = 0; t < tasks_per_req; ++t)
          tasks.push_back({i, t * heads_per_task, j0, j1, p, (j1 - j0) * keys});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  // A split request's partial results: per (row, partition, query head) its max score, sum and D weighted sums.
  const int64_t stat = D + 2;
  std::unique_ptr<float[]> partials(new float[static_cast<size_t>(std::max<int64_t>(num_partials * H * stat, 1))]);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, acc, q_float;
    std::vector<uint32_t> q_pairs;
    std::vector<uint16_t> p_bf16;
#if defined(PAGEDLLM_AMX)
    if (amx_scores) {
      const amx_tiles::TileConfig cfg = attention_bf16::score_tiles(G);
      PAGEDLLM_LOAD_TILE_CONFIG(cfg);
    }
#endif
    // Each thread claims its next task when it starts one, and prefetches that task's blocks while computing this
    // one: a few token rows at each KV head of each PREFETCH_ROWS rows of this task's two passes (TaskPrefetch).
    TaskPrefetch<KV> ahead;
    ahead.blk_stride = blk_stride, ahead.row_stride = tok_stride, ahead.n = block_size, ahead.row_elems = task_elems;
    const auto task_blocks = [&](const Task& t) {  // blocks [first, end) of a task's partition
      const int64_t end = std::min((sl[ri[t.idx]] + block_size - 1) / block_size, (t.part + 1) * part_blocks);
      return std::make_pair(t.part * part_blocks, end);
    };
    for (int64_t pulled = next.fetch_add(1), upcoming; pulled < num_tasks; pulled = upcoming) {
      upcoming = next.fetch_add(1);
      const Task& task = tasks[pulled];
      if (upcoming < num_tasks) {
        const Task& t = tasks[upcoming];
        const auto [first, end] = task_blocks(t);
        const auto [own_first, own_end] = task_blocks(task);
        ahead.start(k_ptr + t.h_begin * D, v_ptr + t.h_begin * D, bt + ri[t.idx] * max_blocks, first, end,
                    2 * (own_end - own_first) * chunks_per_block * heads_per_task * (task.j_end - task.j_begin));
      } else {
        ahead.start(k_ptr, v_ptr, nullptr, 0, 0, 1);  // nothing left to prefetch
      }
      const int64_t i = task.idx, r = ri[i], np = parts[i];
      const int64_t h_begin = task.h_begin, h_end = h_begin + heads_per_task;
      const int64_t seq_len = sl[r];
      const int64_t q_begin = qs[r], q_len = qs[r + 1] - qs[r];
      const int32_t* table = bt + r * max_blocks;
      const int64_t HG = (h_end - h_begin) * G;  // query heads of this task
      const int64_t b0 = task.part * part_blocks;  // this partition's blocks: b0 .. b0 + part_blocks
      acc.resize(static_cast<size_t>(HG * D));
      for (int64_t j = task.j_begin; j < task.j_end; ++j) {
        const int64_t ctx = seq_len - q_len + j + 1;  // keys visible to this query token
        const int64_t nblocks = (ctx + block_size - 1) / block_size;
        float* partial = np > 1 ? partials.get() + ((partial_base[i] + j * np + task.part) * H + h_begin * G) * stat
                                : nullptr;  // [HG, stat] of this row and partition
        if (b0 >= nblocks) {  // an earlier token of a chunk: no keys in this partition
          for (int64_t g = 0; g < HG; ++g) partial[g * stat + 1] = 0.f;
          continue;
        }
        const int64_t b1 = std::min(nblocks, b0 + part_blocks);
        const int64_t k0 = b0 * block_size, nk = std::min(b1 * block_size, ctx) - k0;  // this partition's keys
        scores.resize(static_cast<size_t>(HG * nk));
        // Query heads h_begin*G .. h_end*G of this token, contiguous: [HG, D].
        const Q* q_row_ptr = q_ptr + (q_begin + j) * q_row + h_begin * G * D;
        const float* q = nullptr;
        if constexpr (std::is_same_v<Q, float>) {
          q = q_row_ptr;
        } else if (!bf16_dots) {  // a bf16 model's query: widened once per token here, not by a cast of the batch
          q_float.resize(static_cast<size_t>(HG * D));
          for (int64_t e = 0; e < HG * D; ++e) q_float[e] = static_cast<float>(q_row_ptr[e]);
          q = q_float.data();
        }
        if (amx_scores) {
          q_pairs.resize(static_cast<size_t>(HG * D / 2));
          attention_bf16::pack_query_pairs(reinterpret_cast<const at::BFloat16*>(q_row_ptr), HG, G, D, q_pairs.data());
          asm volatile("" ::: "memory");  // GCC's _tile_loadd declares no memory read: the pairs are stored first
        }
        // Both passes walk this partition's blocks in pieces of PREFETCH_ROWS rows, a KV head at a time, and issue a
        // share of the next task's prefetches before each: visit(head of the task, its rows, n, first key).
        const auto for_each_piece = [&](const KV* cache, auto&& visit) {
          for (int64_t b = b0; b < b1; ++b) {
            const int64_t n_blk = std::min(block_size, ctx - b * block_size);
            for (int64_t r0 = 0; r0 < n_blk; r0 += PREFETCH_ROWS) {
              const KV* rows = cache + table[b] * blk_stride + r0 * tok_stride;
              for (int64_t h = h_begin; h < h_end; ++h) {
                ahead.issue();
                visit(h - h_begin, rows + h * D, std::min(PREFETCH_ROWS, n_blk - r0), (b - b0) * block_size + r0);
              }
            }
          }
        };
        // Pass 1: scaled scores [HG, nk]; the G query heads of a KV head share each K row.
        for_each_piece(k_ptr, [&](int64_t hh, const KV* rows, int64_t n, int64_t key) {
          float* sh = scores.data() + hh * G * nk + key;
#if defined(PAGEDLLM_AMX)
          if constexpr (std::is_same_v<Q, at::BFloat16> && std::is_same_v<KV, at::BFloat16>) {
            if (amx_scores) {
              attention_bf16::score_rows_amx(q_pairs.data() + hh * G * D / 2, G, D, rows, tok_stride, n, fscale, sh,
                                             nk);
              return;
            }
          }
#endif
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<Q, at::BFloat16> && std::is_same_v<KV, at::BFloat16>) {
            if (bf16_dots) {
              score_heads_bf16(q_row_ptr + hh * G * D, G, D, rows, tok_stride, n, fscale, sh, nk);
              return;
            }
          }
#endif
          score_heads(q + hh * G * D, G, D, rows, tok_stride, n, fscale, sh, nk);
        });
        // Softmax numerators in place; the normalisation is applied to the output.
        float max_of[512], sum_of[512];
        TORCH_CHECK(HG <= 512, "at most 512 query heads");
        for (int64_t g = 0; g < HG; ++g) {
          float* sg = scores.data() + g * nk;
          const float max_s = row_max(sg, nk);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < nk; ++t) {
            sg[t] = expf(sg[t] - max_s);  // vectorized by libmvec under -ffast-math
            sum += sg[t];
          }
          max_of[g] = max_s;
          sum_of[g] = sum;
        }
        // Pass 2: weighted sum of V rows, block by block.
        std::fill(acc.begin(), acc.end(), 0.f);
        const int64_t nk_even = nk + nk % 2;  // bf16 probabilities per head, in pairs of keys
#if defined(__AVX512BF16__)
        if (pair_sums) {
          p_bf16.resize(static_cast<size_t>(HG * nk_even));
          for (int64_t g = 0; g < HG; ++g)
            attention_bf16::round_to_bf16(scores.data() + g * nk, nk, p_bf16.data() + g * nk_even);
        }
#endif
        for_each_piece(v_ptr, [&](int64_t hh, const KV* rows, int64_t n, int64_t key) {
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<KV, at::BFloat16>) {
            if (pair_sums) {
              attention_bf16::accumulate_heads_pairs(p_bf16.data() + hh * G * nk_even + key, nk_even, G, rows,
                                                     tok_stride, n, D, acc.data() + hh * G * D);
              return;
            }
          }
#endif
          accumulate_heads(scores.data() + hh * G * nk + key, nk, G, rows, tok_stride, n, D, acc.data() + hh * G * D);
        });
#if defined(__AVX512BF16__)
        if (pair_sums) attention_bf16::unpermute_pairs(acc.data(), HG, D);
#endif
        if (partial != nullptr) {  // combined below, with the row's other partitions
          for (int64_t g = 0; g < HG; ++g) {
            partial[g * stat] = max_of[g];
            partial[g * stat + 1] = sum_of[g];
            std::memcpy(partial + g * stat + 2, acc.data() + g * D, sizeof(float) * D);
          }
          continue;
        }
        Q* o = o_ptr + ((q_begin + j) * H + h_begin * G) * D;
        for (int64_t g = 0; g < HG; ++g) store_row(o + g * D, acc.data() + g * D, v_mul / sum_of[g], D);  // bf16: RNE
      }
      ahead.finish();  // what this task's blocks did not cover (rows with fewer keys, empty partitions)
    }
#if defined(PAGEDLLM_AMX)
    if (amx_scores) amx_tiles::release();
#endif
  });
  if (num_partials == 0) return;
  // Combine each split row's partitions, per query head: rescale each by exp(its max - the row's max).
  std::vector<int64_t> split_reqs;
  for (int64_t i = 0; i < num_reqs; ++i)
    if (parts[i] > 1) split_reqs.push_back(i);
  std::vector<int64_t> row_start(split_reqs.size() + 1, 0);  // rows of the split requests, in order
  for (size_t s = 0; s < split_reqs.size(); ++s) {
    const int64_t r = ri[split_reqs[s]];
    row_start[s + 1] = row_start[s] + qs[r + 1] - qs[r];
  }
  at::parallel_for(0, row_start.back(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum_d(static_cast<size_t>(D));
    for (int64_t row = begin; row < end; ++row) {
      const size_t s = static_cast<size_t>(std::upper_bound(row_start.begin(), row_start.end(), row) -
                                           row_start.begin() - 1);
      const int64_t i = split_reqs[s], r = ri[i], np = parts[i], j = row - row_start[s];
      const float* base = partials.get() + (partial_base[i] + j * np) * H * stat;  // [np, H, stat]
      Q* o = o_ptr + (qs[r] + j) * H * D;
      for (int64_t h = 0; h < H; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < np; ++p) {
          const float* e = base + (p * H + h) * stat;
          if (e[1] > 0.f) m = std::max(m, e[0]);
        }
        float total = 0.f;
        std::fill(sum_d.begin(), sum_d.end(), 0.f);
        for (int64_t p = 0; p < np; ++p) {
          const float* e = base + (p * H + h) * stat;
          if (e[1] == 0.f) continue;
          const float w = expf(e[0] - m);
          total += e[1] * w;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) sum_d[d] += e[2 + d] * w;
        }
        const float inv = v_mul / total;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[h * D + d] = static_cast<Q>(sum_d[d] * inv);
      }
    }
  });
}

}  // namespace

namespace {
// An fp8 cache's (k_scale, v_scale): kv_scale [2] float32 on the host, read at each call (a recorded step graph
// replays with the values of its time, e.g. scales --calculate-kv-scales set after the graphs were recorded);
// none: 1.0 each.
std::pair<float, float> kv_scales(const std::optional<torch::Tensor>& kv_scale) {
  if (!kv_scale.has_value()) return {1.f, 1.f};
  TORCH_CHECK(kv_scale->scalar_type() == torch::kFloat32 && kv_scale->numel() == 2 && kv_scale->is_contiguous() &&
              kv_scale->device().is_cpu(), "kv_scale must be a contiguous float32 [2] CPU tensor (k, v)");
  const float* s = kv_scale->data_ptr<float>();
  return {s[0], s[1]};
}

// write_kv into an fp8 cache: key/value [T, Hkv, D] float32 or bf16 (token rows may be strided).
void write_kv_fp8(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                  torch::Tensor& value_cache, const torch::Tensor& slot_mapping, std::pair<float, float> scales) {
  TORCH_CHECK(key.scalar_type() == torch::kFloat32 || key.scalar_type() == torch::kBFloat16,
              "K/V stored into an fp8 cache must be float32 or bfloat16");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(scales.first > 0.f && scales.second > 0.f, "kv_scale must be positive");
  auto rows = [](const torch::Tensor& t) {
    return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  const torch::Tensor k = rows(key), v = rows(value);
  const int64_t T = k.size(0), row_elems = k.size(1) * k.size(2);
  const int64_t num_slots = key_cache.numel() / std::max<int64_t>(row_elems, 1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  const float k_mul = 1.f / scales.first, v_mul = 1.f / scales.second;
  const auto store = [&](auto kv_tag, auto src_tag) {
    using KV = decltype(kv_tag);
    using Src = decltype(src_tag);
    KV* kd = static_cast<KV*>(key_cache.data_ptr());
    KV* vd = static_cast<KV*>(value_cache.data_ptr());
    const Src* ks = static_cast<const Src*>(k.data_ptr());
    const Src* vs = static_cast<const Src*>(v.data_ptr());
    at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        store_row_fp8(kd + slots[t] * row_elems, ks + t * k.stride(0), k_mul, row_elems);
        store_row_fp8(vd + slots[t] * row_elems, vs + t * v.stride(0), v_mul, row_elems);
      }
    });
  };
  const bool e4m3 = key_cache.scalar_type() == torch::kFloat8_e4m3fn;
  if (key.scalar_type() == torch::kFloat32) {
    e4m3 ? store(Fp8E4M3{}, float{}) : store(Fp8E5M2{}, float{});
  } else {
    e4m3 ? store(Fp8E4M3{}, at::BFloat16{}) : store(Fp8E5M2{}, at::BFloat16{});
  }
}
}  // namespace

// Attention for the requests listed in req_indices [n] int32; query/out float32 (the cache float32, bf16 or fp8) or
// bf16 (a bf16 or fp8 cache). allow_amx=false keeps a bf16 query's scores on the AVX-512 dot products (tests
// compare). kv_scale: an fp8 cache's per-layer scales (stored = value / scale); ignored for other caches.
void paged_attention(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                     const torch::Tensor& query_start, torch::Tensor& out, double scale,
                     const torch::Tensor& req_indices, bool allow_amx, const std::optional<torch::Tensor>& kv_scale) {
  const bool bf16_query = query.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((query.scalar_type() == torch::kFloat32 || bf16_query) && out.scalar_type() == query.scalar_type(),
              "query/out must both be float32, or both bfloat16");
  const auto kv_type = key_cache.scalar_type();
  const bool fp8 = kv_type == torch::kFloat8_e4m3fn || kv_type == torch::kFloat8_e5m2;
  TORCH_CHECK(!bf16_query || kv_type == torch::kBFloat16 || fp8, "a bfloat16 query needs a bfloat16 or fp8 cache");
  TORCH_CHECK(value_cache.scalar_type() == kv_type, "key and value caches must share a dtype");
  TORCH_CHECK(req_indices.scalar_type() == torch::kInt32 && block_tables.scalar_type() == torch::kInt32 &&
              seq_lens.scalar_type() == torch::kInt32 && query_start.scalar_type() == torch::kInt32,
              "index tensors must be int32");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "query heads must be contiguous per token");
  TORCH_CHECK(out.is_contiguous() && key_cache.is_contiguous() &&
              value_cache.is_contiguous() && block_tables.is_contiguous(), "inputs must be contiguous");
  if (fp8) {
    const std::pair<float, float> scales = kv_scales(kv_scale);
    const auto dispatch = [&](auto kv_tag) {
      using KV = decltype(kv_tag);
      const float k_mul = scales.first * kv_unit<KV>(), v_mul = scales.second * kv_unit<KV>();
      if (bf16_query) {
        run<KV, at::BFloat16>(query, key_cache, value_cache, block_tables, seq_lens, query_start, out, scale,
                              req_indices, allow_amx, k_mul, v_mul);
      } else {
        run<KV, float>(query, key_cache, value_cache, block_tables, seq_lens, query_start, out, scale, req_indices,
                       allow_amx, k_mul, v_mul);
      }
    };
    if (kv_type == torch::kFloat8_e4m3fn) {
      dispatch(Fp8E4M3{});
    } else {
      dispatch(Fp8E5M2{});
    }
  } else if (key_cache.scalar_type() == torch::kFloat32) {
    run<float, float>(query, key_cache, value_cache, block_tables, seq_lens, query_start, out, scale, req_indices,
                      allow_amx);
  } else if (key_cache.scalar_type() == torch::kBFloat16) {
    if (bf16_query) {
      run<at::BFloat16, at::BFloat16>(query, key_cache, value_cache, block_tables, seq_lens, query_start, out, scale,
                                      req_indices, allow_amx);
    } else {
      run<at::BFloat16, float>(query, key_cache, value_cache, block_tables, seq_lens, query_start, out, scale,
                               req_indices, allow_amx);
    }
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
  }
}

// Store this step's K/V: key/value [T, Hkv, D] (token rows may be strided, e.g. slices of the fused qkv
// output) into caches [num_blocks * block_size, Hkv, D] at slot_mapping [T]. K/V of the cache's dtype are copied;
// float32 K/V into a bfloat16 cache (--kv-cache-dtype bfloat16 under a float32 model) are rounded to nearest even,
// bfloat16 K/V into a float32 cache (--kv-cache-dtype float32 under a bf16 model) widened (exactly); float32 or
// bfloat16 K/V into an fp8 cache stored as value / scale (kv_scale's), saturated and rounded to nearest even.
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
              torch::Tensor& value_cache, const torch::Tensor& slot_mapping,
              const std::optional<torch::Tensor>& kv_scale) {
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "K and V must share a dtype, and so must their caches");
  const auto cache_type = key_cache.scalar_type();
  if (cache_type == torch::kFloat8_e4m3fn || cache_type == torch::kFloat8_e5m2) {
    write_kv_fp8(key, value, key_cache, value_cache, slot_mapping, kv_scales(kv_scale));
    return;
  }
  const bool rounds = key.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kBFloat16;
  const bool widens = key.scalar_type() == torch::kBFloat16 && key_cache.scalar_type() == torch::kFloat32;
  TORCH_CHECK(rounds || widens || key.scalar_type() == key_cache.scalar_type(),
              "K/V dtype must match the cache (or be float32 and bfloat16, either way)");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  auto rows = [](const torch::Tensor& t) {  // each token's [Hkv, D] must be one contiguous run
    return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  const torch::Tensor k = rows(key), v = rows(value);
  const int64_t T = k.size(0);
  const int64_t row_elems = k.size(1) * k.size(2);
  const int64_t row_bytes = row_elems * key_cache.element_size();  // one token's row in the cache
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  const int64_t num_slots = key_cache.numel() * key_cache.element_size() / std::max<int64_t>(row_bytes, 1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kd = static_cast<char*>(key_cache.data_ptr());
  char* vd = static_cast<char*>(value_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (rounds) {
        store_row(reinterpret_cast<at::BFloat16*>(kd + slots[t] * row_bytes),
                  reinterpret_cast<const float*>(ks + t * k_stride), 1.f, row_elems);
        store_row(reinterpret_cast<at::BFloat16*>(vd + slots[t] * row_bytes),
                  reinterpret_cast<const float*>(vs + t * v_stride), 1.f, row_elems);
      } else if (widens) {
        load_row(reinterpret_cast<float*>(kd + slots[t] * row_bytes),
                 reinterpret_cast<const at::BFloat16*>(ks + t * k_stride), row_elems);
        load_row(reinterpret_cast<float*>(vd + slots[t] * row_bytes),
                 reinterpret_cast<const at::BFloat16*>(vs + t * v_stride), row_elems);
      } else {
        std::memcpy(kd + slots[t] * row_bytes, ks + t * k_stride, row_bytes);
        std::memcpy(vd + slots[t] * row_bytes, vs + t * v_stride, row_bytes);
      }
    }
  });
}
