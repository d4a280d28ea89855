// Bidirectional bf16 attention on AVX-512 BF16 dot products, for CPUs with avx512_bf16 and no AMX (AMD Zen 4 and
// Zen 5): the two matmuls of encoder_attention_bf16.h's passes as vdpbf16ps, each adding two bf16 products into 16
// float lanes. The packed K and V rows are exactly vdpbf16ps's second operand (16 lanes of bf16 pairs), so the
// layouts of the AMX kernel serve unchanged; the query rows and the probabilities come in as broadcast pairs.
// On torch's flash kernel these CPUs spend 32 ms a layer of Whisper base's encoder (AMD Zen 4, 2 threads), against
// 12.9 here; causal (a decoder's prompts and their later chunks) it also skips the keys past each block of rows
// (docs/performance.md).
#include "encoder_attention_bf16.h"
#include "kernels.h"

bool encoder_attention_avx512bf16_takes(const torch::Tensor& query) {
#if defined(__x86_64__)
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
#else
  static const bool cpu = false;
#endif
  return cpu && query.scalar_type() == torch::kBFloat16 && (query.size(2) == 32 || query.size(2) == 64);
}

#if defined(__x86_64__)
namespace {

using encoder_bf16::KC;
using encoder_bf16::KT;
using encoder_bf16::QB;
using encoder_bf16::Task;

// Register blocks of 16 accumulators (plus the operands: 32 registers): independent chains enough to cover
// vdpbf16ps's latency of several cycles at one or two issued a cycle.
constexpr int SR = 8;  // pass 1: 8 query rows x 2 key tiles

// The 32-bit pair at u32 index i of a bf16 buffer, in all 16 lanes.
__attribute__((target("avx512f"))) inline __m512bh broadcast_pair(const uint16_t* base, int64_t i) {
  int32_t two;
  std::memcpy(&two, base + 2 * i, 4);
  return (__m512bh)_mm512_set1_epi32(two);
}

struct DotPasses {
  static void begin() {}
  static void end() {}

  // Pass 1: S = Q K^T over the task's Lk keys, SR rows x 32 keys at a time: per dim pair, two K rows (16 keys
  // each) and SR broadcast query pairs.
  template <int CH>
  __attribute__((target("avx512f,avx512bf16"))) static void scores(const Task& t, float* s) {
    const int64_t key_tiles = t.Lp / KT, span_tiles = t.Lk / KT;
    for (int64_t r0 = 0; r0 < t.rows; r0 += SR) {
      const uint16_t* q[SR];
      for (int r = 0; r < SR; ++r) q[r] = t.q + (r0 + r) * (t.q_stride / 2);
      for (int64_t kt = 0; kt < span_tiles; kt += 2) {  // Lk is a multiple of 32: key tiles come in pairs
        __m512 acc[SR][2];
        for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
        for (int c = 0; c < CH; ++c) {
          const uint32_t* k0 = t.kp + (c * key_tiles + kt) * 256;
          for (int p = 0; p < 16; ++p) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(k0 + 16 * p);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(k0 + 256 + 16 * p);
            for (int r = 0; r < SR; ++r) {
              const __m512bh a = broadcast_pair(q[r], 16 * c + p);
              acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
              acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            }
          }
        }
        for (int r = 0; r < SR; ++r) {
          _mm512_storeu_ps(s + encoder_bf16::s_index(r0 + r, kt, t.Lk), acc[r][0]);
          _mm512_storeu_ps(s + encoder_bf16::s_index(r0 + r, kt + 1, t.Lk), acc[r][1]);
        }
      }
    }
  }

  // Pass 3: O [QB, D] = P V, VR rows x all D dims at a time (VR = 16 / (D / 16)): per pair of keys, D / 16 V rows
  // and VR broadcast probability pairs.
  template <int CH>
  __attribute__((target("avx512f,avx512bf16"))) static void values(const Task& t, const uint16_t* p, float* o) {
    constexpr int DT = 2 * CH, VR = 16 / DT, D = 32 * CH;
    const int64_t chunks = t.Lk / KC;
    for (int64_t r0 = 0; r0 < t.rows; r0 += VR) {
      __m512 acc[VR][DT];
      for (auto& row : acc)
        for (auto& a : row) a = _mm512_setzero_ps();
      for (int64_t kc = 0; kc < chunks; ++kc) {
        const uint32_t* v = t.vp + kc * DT * 256;
        const uint16_t* pr[VR];
        for (int r = 0; r < VR; ++r) pr[r] = p + encoder_bf16::p_index(r0 + r, kc, t.Lk);
        for (int j = 0; j < 16; ++j) {
          __m512bh b[DT];
          for (int d = 0; d < DT; ++d) b[d] = (__m512bh)_mm512_loadu_si512(v + d * 256 + 16 * j);
          for (int r = 0; r < VR; ++r) {
            const __m512bh a = broadcast_pair(pr[r], j);
            for (int d = 0; d < DT; ++d) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], a, b[d]);
          }
        }
      }
      for (int r = 0; r < VR; ++r)
        for (int d = 0; d < DT; ++d) _mm512_storeu_ps(o + (r0 + r) * D + 16 * d, acc[r][d]);
    }
  }
};

static_assert(QB % SR == 0 && QB % 8 == 0, "row blocks must tile a task's rows");

}  // namespace

void encoder_attention_avx512bf16(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                  torch::Tensor& out, const int32_t* qs, const int32_t* ks, int64_t num_seqs,
                                  float scale, bool causal) {
  TORCH_CHECK(encoder_attention_avx512bf16_takes(query),
              "encoder_attention_avx512bf16: needs bf16, D of 32 or 64 and AVX-512 BF16");
  encoder_bf16::run<DotPasses>(query, key, value, out, qs, ks, num_seqs, scale, causal);
}
#else
void encoder_attention_avx512bf16(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, torch::Tensor&,
                                  const int32_t*, const int32_t*, int64_t, float, bool) {
  TORCH_CHECK(false, "encoder_attention_avx512bf16: needs an x86-64 CPU");
}
#endif
