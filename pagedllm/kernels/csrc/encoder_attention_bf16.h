// The frame of the bf16 encoder attention kernels (Whisper's 1,500 audio positions, BERT-style prompts): whatever
// runs the two matmuls, AMX tiles (encoder_attention_amx.cpp) or AVX-512 BF16 dot products
// (encoder_attention_avx512bf16.cpp), the work around them is the same and lives here.
//
// Per (sequence, KV head) K and V are packed once into pairs of bf16 (the B operand of tdpbf16ps, and 16 lanes of
// vdpbf16ps); then each task, one query head and 32 query rows, runs in three passes over buffers that stay in L2
// (the whole row of scores, not an online softmax: no rescaling of accumulators):
//   1. S [32, Lp] = Q K^T                                     (Passes::scores)
//   2. per row: max, p = exp(scale (s - max)), their float32 sum, p rounded to bf16 into P [32, Lp]  (softmax_row)
//   3. O [32, D] = P V; O / sum -> out                       (Passes::values, store_scaled)
// Rounding the probabilities to bf16 before P . V is what torch's flash kernel does too: against a float32 reference
// both err by the same (mean 1.20e-3 and 1.17e-3 on random data). torch's kernel spends most of its time in an
// accurate exp; the polynomial exp here has a relative error < 3e-6, far below that rounding.
//
// Layouts (uint32 = two bf16; Lp is the length rounded up to 32 keys; padded keys have zero K and V and get
// probability 0):
//   packed K [D / 32][Lp / 16][16 dim pairs][16 keys]   packed V [Lp / 32][D / 16][16 key pairs][16 dims]
//   S float [2 halves of 16 rows][Lk / 16][16 rows][16 keys]   P bf16 [2 halves][Lk / 32][16 rows][32 keys]
// (S and P tile by tile: each tile's 1 KiB in one piece, which AMX's tile stores and loads run fastest on). Lk, the
// keys a task attends, is Lp; a causal task stops at its last row's own position, rounded up to 32, and its rows'
// probabilities past their own position are 0. Causal, a sequence's Lq queries are the last Lq of its L positions
// (a decoder's fresh prompt: Lq = L; a later chunk or the rest of a prefix-cache hit: L - Lq keys of context), and
// query row i sees keys 0 .. L - Lq + i.
//
// Shapes as encoder_attention (encoder_attention.cpp): query [Tq, H, D], key / value [Tk, Hkv, D] bf16 with strided
// rows, query_start and key_start [R + 1] int32 (host), out [Tq, H, D]. D is 32 or 64.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "simd/exp2_poly.h"
#endif

namespace encoder_bf16 {

constexpr int64_t QB = 32;  // query rows per task
constexpr int64_t KT = 16;  // keys per score tile
constexpr int64_t KC = 32;  // keys per P . V step (16 pairs)

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// A buffer of at least n elements, kept per thread between calls (a fresh allocation each call would fault in its
// pages every time: 100s of KiB a call). Contents are whatever the last call left.
template <typename T, int Slot>
T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// One task's inputs: the query rows of one head and its KV head's packed K and V.
struct Task {
  const uint16_t* q;  // the block's first query row, this head
  int64_t q_stride;   // bytes between query rows
  int64_t rows;       // real query rows (<= QB); rows past it read zeros
  const uint32_t* kp;
  const uint32_t* vp;
  int64_t L, Lp;      // the sequence's keys, and as packed (the stride of packed K's chunks of 32 dims)
  int64_t Lk;         // keys this task attends (a multiple of KC <= Lp): the length of its rows of S and P
};

// Where row r's first score of key tile kt sits in S, and row r's first probability of key chunk kc in P.
inline int64_t s_index(int64_t r, int64_t kt, int64_t Lk) { return (r / 16) * Lk * 16 + kt * 256 + (r % 16) * 16; }
inline int64_t p_index(int64_t r, int64_t kc, int64_t Lk) { return (r / 16) * Lk * 16 + kc * 512 + (r % 16) * 32; }

#if defined(__x86_64__)
// In place: r[i] lane j <- r[j] lane i, for 16 rows of 16 32-bit lanes.
__attribute__((target("avx512f"))) inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: pairs of rows interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + k], lane l: rows g .. g + 3 of column 4 l + k
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4 l + k: lane l of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i v0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), v1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    t[k] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    t[8 + k] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// One (sequence, KV head)'s K and V into the packed layouts above (keys past L are zeros).
__attribute__((target("avx512f,avx512bw"))) inline void pack_kv(const uint16_t* k, int64_t k_row, const uint16_t* v,
                                                                int64_t v_row, int64_t L, int64_t D, int64_t Lp,
                                                                uint32_t* kp, uint32_t* vp) {
  const int64_t key_tiles = Lp / KT, dim_tiles = D / 16;
  for (int64_t kt = 0; kt < key_tiles; ++kt)
    for (int64_t c = 0; c < D / 32; ++c) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t j = kt * KT + i;
        r[i] = j < L ? _mm512_loadu_si512(k + j * k_row + 32 * c) : _mm512_setzero_si512();
      }
      transpose_16x16(r);
      uint32_t* dst = kp + (c * key_tiles + kt) * 256;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + 16 * p, r[p]);
    }
  // Two V rows x, y of 32 dims -> the rows of their two dim tiles: x[i], y[i] at 2 i, 2 i + 1 (y is lanes 32 on).
  alignas(64) uint16_t idx[2][32];
  for (int i = 0; i < 16; ++i) {
    idx[0][2 * i] = i, idx[0][2 * i + 1] = 32 + i;
    idx[1][2 * i] = 16 + i, idx[1][2 * i + 1] = 48 + i;
  }
  const __m512i lo = _mm512_load_si512(idx[0]), hi = _mm512_load_si512(idx[1]);
  for (int64_t j = 0; j < Lp; j += 2)
    for (int64_t c = 0; c < D / 32; ++c) {
      const __m512i x = j < L ? _mm512_loadu_si512(v + j * v_row + 32 * c) : _mm512_setzero_si512();
      const __m512i y = j + 1 < L ? _mm512_loadu_si512(v + (j + 1) * v_row + 32 * c) : _mm512_setzero_si512();
      uint32_t* dst = vp + ((j / KC) * dim_tiles + 2 * c) * 256 + ((j % KC) / 2) * 16;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(dst + 256, _mm512_permutex2var_epi16(x, hi, y));
    }
}

// Pass 2 for one row: its Lp scores, of which the first L are real, 16 keys at a time s_step apart -> its
// probabilities in bf16 (0 past L), 32 keys at a time p_step apart, and 1 / their float32 sum. c = scale * log2(e).
__attribute__((target("avx512f,avx512dq,avx512bf16,avx512bw"))) inline float softmax_row(
    const float* s, int64_t s_step, int64_t L, int64_t Lp, float c, uint16_t* p, int64_t p_step) {
  // Four maxima and two sums in flight: one accumulator would chain every vector on the last one's latency.
  __m512 m[4];
  for (auto& x : m) x = _mm512_set1_ps(-3.0e38f);
  int64_t j = 0;
  for (; j + 64 <= L; j += 64)
    for (int u = 0; u < 4; ++u) m[u] = _mm512_max_ps(m[u], _mm512_loadu_ps(s + (j / 16 + u) * s_step));
  for (; j < L; j += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, L - j)) - 1);
    m[0] = _mm512_mask_max_ps(m[0], mask, m[0], _mm512_loadu_ps(s + j / 16 * s_step));
  }
  const float row_max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
  const __m512 vc = _mm512_set1_ps(c), offset = _mm512_set1_ps(row_max * c);
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (j = 0; j + 32 <= L; j += 32, p += p_step) {
    __m512 e[2];
    for (int h = 0; h < 2; ++h) {
      e[h] = exp2_poly(_mm512_fmsub_ps(_mm512_loadu_ps(s + (j / 16 + h) * s_step), vc, offset));
      sum[h] = _mm512_add_ps(sum[h], e[h]);
    }
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
  }
  for (; j < Lp; j += 32, p += p_step) {  // the last, partial chunk and any wholly padded one
    __m512 e[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t valid = std::clamp<int64_t>(L - j - 16 * h, 0, 16);
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
      const __m512 t = _mm512_fmsub_ps(_mm512_loadu_ps(s + (j / 16 + h) * s_step), vc, offset);
      e[h] = _mm512_maskz_mov_ps(mask, exp2_poly(t));
      sum[h] = _mm512_add_ps(sum[h], e[h]);
    }
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
  }
  return 1.f / _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
}

// out row [D] bf16 = o [D] * mul, rounded to nearest even.
__attribute__((target("avx512f,avx512bf16,avx512bw"))) inline void store_scaled(const float* o, float mul,
                                                                                 int64_t D, uint16_t* out) {
  const __m512 m = _mm512_set1_ps(mul);
  for (int64_t d = 0; d < D; d += 32)
    _mm512_storeu_si512(out + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + d + 16), m),
                                                             _mm512_mul_ps(_mm512_loadu_ps(o + d), m)));
}

// Every task of one call. Passes (a kernel's matmuls) has:
//   static void begin(), end()                     once per thread around its tasks (AMX: configure, release)
//   template <int CH> static void scores(const Task&, float* s)                 S = Q K^T (pass 1)
//   template <int CH> static void values(const Task&, const uint16_t* p, float* o)   O [QB, D] = P V (pass 3)
// CH is D / 32. Rows past task.rows may hold anything in S and O: they are never read. Passes that read only
// Lp (not Lk) run only non-causal calls, where the two are equal.
template <typename Passes, int CH>
void run_tasks(const uint16_t* q_ptr, int64_t q_row, const uint16_t* k_ptr, int64_t k_row, const uint16_t* v_ptr,
               int64_t v_row, uint16_t* o_ptr, const int32_t* qs, const int32_t* ks, int64_t num_seqs, int64_t H,
               int64_t Hkv, float scale, bool causal) {
  constexpr int64_t D = 32 * CH;
  const int64_t group = H / Hkv;
  // Packed K/V of every (sequence, KV head), and the task list: (sequence, query head, block of QB rows).
  std::vector<int64_t> packed_at(num_seqs * Hkv + 1, 0);
  int64_t max_lp = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t Lp = round_up(ks[i + 1] - ks[i], KC);
    max_lp = std::max(max_lp, Lp);
    for (int64_t hk = 0; hk < Hkv; ++hk) packed_at[i * Hkv + hk + 1] = packed_at[i * Hkv + hk] + Lp * D / 2;
  }
  uint32_t* kp = scratch<uint32_t, 0>(packed_at.back());
  uint32_t* vp = scratch<uint32_t, 1>(packed_at.back());
  at::parallel_for(0, num_seqs * Hkv, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t seq = t / Hkv, hk = t % Hkv, start = ks[seq], L = ks[seq + 1] - start;
      pack_kv(k_ptr + start * k_row + hk * D, k_row, v_ptr + start * v_row + hk * D, v_row, L, D, round_up(L, KC),
              kp + packed_at[t], vp + packed_at[t]);
    }
  });
  std::vector<int64_t> task_seq, task_head, task_row;
  for (int64_t i = 0; i < num_seqs; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < qs[i + 1] - qs[i]; r += QB) {
        task_seq.push_back(i);
        task_head.push_back(h);
        task_row.push_back(r);
      }
  const float c = scale * LOG2E;
  at::parallel_for(0, static_cast<int64_t>(task_seq.size()), 1, [&](int64_t t0, int64_t t1) {
    float* s = scratch<float, 2>(QB * max_lp);
    float* o = scratch<float, 3>(QB * D);
    uint16_t* p = scratch<uint16_t, 4>(QB * max_lp);
    uint16_t* q_tail = scratch<uint16_t, 5>(QB * D);
    float inv_sum[QB];
    Passes::begin();
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t seq = task_seq[ti], h = task_head[ti], i0 = task_row[ti], start = qs[seq];
      const int64_t Lq = qs[seq + 1] - start, L = ks[seq + 1] - ks[seq], slot = seq * Hkv + h / group;
      const int64_t Lp = round_up(L, KC), context = L - Lq;  // causal: keys before the first query's position
      Task t{q_ptr + (start + i0) * q_row + h * D, q_row * 2, std::min(QB, Lq - i0), kp + packed_at[slot],
             vp + packed_at[slot], L, Lp, causal ? round_up(std::min(L, context + i0 + QB), KC) : Lp};
      if (t.rows < QB) {  // the last block: its rows past Lq would be read from the next sequence or past the end
        std::memset(q_tail, 0, QB * D * 2);
        for (int64_t r = 0; r < t.rows; ++r) std::memcpy(q_tail + r * D, t.q + r * q_row, D * 2);
        t.q = q_tail;
        t.q_stride = D * 2;
      }
      Passes::template scores<CH>(t, s);
      for (int64_t r = 0; r < QB; ++r) {
        uint16_t* pr = p + p_index(r, 0, t.Lk);
        if (r < t.rows) {
          const int64_t seen = causal ? context + i0 + r + 1 : L;  // keys this row attends
          inv_sum[r] = softmax_row(s + s_index(r, 0, t.Lk), 16 * KT, seen, t.Lk, c, pr, 16 * KC);
        } else {
          for (int64_t j = 0; j < t.Lk; j += KC, pr += 16 * KC) std::memset(pr, 0, KC * 2);
        }
      }
      Passes::template values<CH>(t, p, o);
      for (int64_t r = 0; r < t.rows; ++r)
        store_scaled(o + r * D, inv_sum[r], D, o_ptr + ((start + i0 + r) * H + h) * D);
    }
    Passes::end();
  });
}

// Runs Passes over one call's tensors (checked by encoder_attention; D is 64 or 32).
template <typename Passes>
void run(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& out,
         const int32_t* qs, const int32_t* ks, int64_t num_seqs, float scale, bool causal) {
  const auto u16 = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t H = query.size(1), Hkv = key.size(1);
  if (query.size(2) == 64) {
    run_tasks<Passes, 2>(u16(query), query.stride(0), u16(key), key.stride(0), u16(value), value.stride(0), o, qs, ks,
                         num_seqs, H, Hkv, scale, causal);
  } else {
    run_tasks<Passes, 1>(u16(query), query.stride(0), u16(key), key.stride(0), u16(value), value.stride(0), o, qs, ks,
                         num_seqs, H, Hkv, scale, causal);
  }
}
#endif  // __x86_64__

}  // namespace encoder_bf16
