// The multi-LoRA term of one linear layer in one call (Punica's segmented gather matmul, SGMV, on the CPU):
// y[t] += (x[t] @ A[s]) @ B[s] for every row t whose adapter slot s = row_slots[t] is >= 0; rows of slot -1 (the
// base model) are left as they are.
//
// The rows are grouped by slot inside the kernel (a counting sort of row_slots), so the caller passes one int32 per
// row and no plan: the same call, recorded once in a CPU step graph, serves any mix of adapters at replay. Work is
// cut into blocks of up to kRows rows of one slot. Phase one (shrink) computes h = x @ A for each block, reading
// A's row k once for all of the block's rows; phase two (expand) adds h @ B into y by column chunks, reading each
// row of B once per block and chunk; both keep their sums in registers (tiles of up to 8 rows by 16 columns of h,
// 8 rows by 32 columns of y). Both phases are thread-parallel (blocks, then block x column chunk): a batch-1
// decode still spreads B, the bigger matrix, over the cores.
//
// A [S, K, R] and B [S, R, N] are slot buffers (float32, or bf16 beside a bf16 model: half the bytes a decode
// reads), R = bands * max_rank: band b of a fused layer (q/k/v, gate/up) lives in columns
// [b * max_rank, b * max_rank + slot_ranks[s]) of A and the same rows of B; the columns past an adapter's rank are
// zero and skipped. band_cols [S, bands, 2] gives the y columns [lo, hi) each band of a slot writes (a fused
// layer's shard: q's band writes q's columns only), so an expand tile reads only the bands that reach it and a band
// an adapter leaves out (lo == hi) is skipped in both passes. The scaling is folded into B. Arithmetic is float32;
// a bf16 y gets one rounding. Each row's sums run in a fixed order whatever the batch, so a request's result
// never depends on the rows beside it.
//
// bf16 rows with bf16 slot buffers on a CPU with AVX-512 BF16 take vdpbf16ps tiles instead (32 products per
// instruction where the float path widens each bf16 value and multiplies 16 at a time): pairs of A's rows (k, k+1)
// and of B's rows (r, r+1) are interleaved in registers as the instruction reads them, x's pairs broadcast as they
// sit in memory, and h is rounded to bf16 once per block before the expand: the term then carries a relative error
// of up to 2^-9 (its own bf16 rounding), far below that of the bf16 y it is added to. Every row still runs one
// fixed sequence of operations.
#include "cpu_features.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 8;    // rows of one slot per block: B's rows are read once for these
constexpr int64_t kCols = 128;  // y columns per expand work unit

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v.x) << 16); }

inline void narrow(float* p, float v) { *p = v; }
inline void narrow(c10::BFloat16* p, float v) {  // nearest even (finite values: -ffast-math)
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  p->x = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Block {
  int64_t slot;
  int64_t first;  // index into the rows sorted by slot
  int64_t count;
};

constexpr int64_t kLanes = 16;  // h columns per shrink tile: one AVX-512 register (two AVX2 ones)
constexpr int64_t kTile = 32;   // y columns per expand tile

// Whether columns [g0, g0 + w) of R hold any live column (column c is live when c % max_rank < rank and its band
// writes some columns of y; cols: the slot's band_cols).
inline bool group_live(int64_t g0, int64_t w, int64_t max_rank, int64_t rank, const int32_t* cols) {
  for (int64_t c = g0; c < g0 + w; ++c) {
    const int64_t band = c / max_rank;
    if (c % max_rank < rank && cols[2 * band] < cols[2 * band + 1]) return true;
  }
  return false;
}

// Whether band b of a slot (cols: its band_cols) writes any of y's columns [c0, c0 + w).
inline bool band_reaches(const int32_t* cols, int64_t band, int64_t c0, int64_t w) {
  return cols[2 * band] < c0 + w && cols[2 * band + 1] > c0;
}

// Calls f.template operator()<M>() with M = count (1..kRows): the tiles' row loops get a constant trip count, so
// their accumulators stay in registers.
template <typename F>
inline void with_rows(int64_t count, F&& f) {
  switch (count) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

// h[j][0..w) = sum over k of xf[j][k] * a[k][0..w) for M rows; W: w as a constant (0: use the runtime w).
template <int M, int W, typename TW>
inline void shrink_tile(const float* xf, int64_t K, const TW* a, int64_t a_stride, float* h, int64_t h_stride,
                        int64_t w_runtime) {
  const int64_t w = W > 0 ? W : w_runtime;
  float acc[M][kLanes] = {};
  for (int64_t k = 0; k < K; ++k) {
    const TW* ak = a + k * a_stride;
    for (int j = 0; j < M; ++j) {
      const float xv = xf[j * K + k];
#pragma omp simd
      for (int64_t c = 0; c < (W > 0 ? W : w); ++c) acc[j][c] += xv * widen(ak[c]);
    }
  }
  for (int j = 0; j < M; ++j)
    for (int64_t c = 0; c < w; ++c) h[j * h_stride + c] = acc[j][c];
}

// y[j][c0 + 0..w) += sum over the live r of h[j][r] * b[r][0..w) for M rows (b: B's column c0 onwards).
template <int M, int W, typename TW, typename TY>
inline void expand_tile(const float* h, int64_t R, const TW* b, int64_t N, int64_t bands, int64_t max_rank,
                        int64_t rank, const int32_t* cols, TY* const* yrows, int64_t c0, int64_t w_runtime) {
  const int64_t w = W > 0 ? W : w_runtime;
  float acc[M][kTile] = {};
  for (int64_t band = 0; band < bands; ++band) {
    if (!band_reaches(cols, band, c0, w)) continue;
    for (int64_t r = band * max_rank; r < band * max_rank + rank; ++r) {
      const TW* br = b + r * N;
      for (int j = 0; j < M; ++j) {
        const float hv = h[j * R + r];
#pragma omp simd
        for (int64_t c = 0; c < (W > 0 ? W : w); ++c) acc[j][c] += hv * widen(br[c]);
      }
    }
  }
  for (int j = 0; j < M; ++j) {
    TY* yr = yrows[j] + c0;
#pragma omp simd
    for (int64_t c = 0; c < w; ++c) narrow(yr + c, widen(yr[c]) + acc[j][c]);
  }
}

// The rows of live slots sorted by slot (``order``: row indices) and cut into blocks of up to kRows rows of one
// slot; a slot's rows split evenly (25 rows: 7, 6, 6, 6, not 8, 8, 8, 1), so no tile runs a lone row.
struct Plan {
  std::vector<int64_t> order;
  std::vector<Block> blocks;
};

Plan plan_blocks(const int32_t* ranks, const int32_t* row_slots, int64_t T, int64_t S) {
  // Rows by slot (counting sort: stable, so rows stay in batch order within a slot).
  std::vector<int64_t> starts(static_cast<size_t>(S) + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = row_slots[t];
    TORCH_CHECK(s < S, "lora_sgmv_: row ", t, " names slot ", s, " of ", S);
    if (s >= 0 && ranks[s] > 0) ++starts[s + 1];
  }
  for (int64_t s = 0; s < S; ++s) starts[s + 1] += starts[s];
  Plan plan;
  const int64_t live = starts[S];
  if (live == 0) return plan;
  plan.order.resize(static_cast<size_t>(live));
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = row_slots[t];
    if (s >= 0 && ranks[s] > 0) plan.order[next[s]++] = t;
  }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t rows = starts[s + 1] - starts[s];
    const int64_t pieces = (rows + kRows - 1) / kRows;
    for (int64_t p = 0, at = starts[s]; p < pieces; ++p) {
      const int64_t count = rows / pieces + (p < rows % pieces ? 1 : 0);
      plan.blocks.push_back({s, at, count});
      at += count;
    }
  }
  return plan;
}

// The term's two passes over a plan, each on the pool unless the term is tiny (waking the pool costs more than it
// saves): shrink(bi) for every block (its rows' h = x @ A[s]), then expand(bi, n0, width) for every block and chunk
// of up to kCols y columns from n0 (y += h @ B[s]).
template <typename Shrink, typename Expand>
void run_passes(const Plan& plan, int64_t K, int64_t R, int64_t N, int64_t max_rank, Shrink&& shrink,
                Expand&& expand) {
  const int64_t live = static_cast<int64_t>(plan.order.size());
  const int64_t num_blocks = static_cast<int64_t>(plan.blocks.size());
  const int64_t col_chunks = (N + kCols - 1) / kCols;
  const int64_t flops = live * (K + N) * std::min<int64_t>(R, R / max_rank * 16);
  const int64_t grain = flops < (1 << 15) ? num_blocks * col_chunks : 1;
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t bi = begin; bi < end; ++bi) shrink(bi);
  });
  at::parallel_for(0, num_blocks * col_chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t n0 = (unit % col_chunks) * kCols;
      expand(unit / col_chunks, n0, std::min(kCols, N - n0));
    }
  });
}

// M rows of h (row stride R) over every kLanes-column group [g0, g0 + w): zeros where the slot's rank has no
// column, else tile(g0, w).
template <int M, typename Tile>
inline void shrink_groups(float* hb, int64_t R, int64_t max_rank, int64_t rank, const int32_t* cols, Tile&& tile) {
  for (int64_t g0 = 0; g0 < R; g0 += kLanes) {
    const int64_t w = std::min(kLanes, R - g0);
    if (!group_live(g0, w, max_rank, rank, cols)) {
      for (int64_t j = 0; j < M; ++j) std::fill(hb + j * R + g0, hb + j * R + g0 + w, 0.f);
    } else {
      tile(g0, w);
    }
  }
}

#if defined(__x86_64__)
#define PAGEDLLM_LORA_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// 16 lanes of (lo[c], hi[c]) bf16 pairs from two rows of up to 16 bf16 values (``mask``: the columns read; hi
// nullptr: zeros), as vdpbf16ps reads a pair: the low half is the pair's first element.
PAGEDLLM_LORA_BF16 inline __m512i pair_rows(const uint16_t* lo, const uint16_t* hi, __mmask16 mask) {
  const __m512i l = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, lo));
  if (hi == nullptr) return l;
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, hi));
  return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

inline int32_t load_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// h[j][0..w) = sum over k of x_j[k] * a[k][0..w) (w <= 16 columns, a's row stride R) for M rows of bf16 x.
template <int M>
PAGEDLLM_LORA_BF16 void shrink_tile_bf16(const uint16_t* const* xrows, int64_t K, const uint16_t* a, int64_t R,
                                         float* h, int64_t h_stride, int64_t w) {
  const __mmask16 mask = static_cast<__mmask16>((1u << w) - 1u);
  __m512 acc[M];
  for (int j = 0; j < M; ++j) acc[j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    const __m512bh ap = (__m512bh)pair_rows(a + k * R, a + (k + 1) * R, mask);
    for (int j = 0; j < M; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(load_pair(xrows[j] + k)), ap);
  }
  if (k < K) {  // odd K: the last k pairs with zeros
    const __m512bh ap = (__m512bh)pair_rows(a + k * R, nullptr, mask);
    for (int j = 0; j < M; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(xrows[j][k]), ap);
  }
  for (int j = 0; j < M; ++j) _mm512_mask_storeu_ps(h + j * h_stride, mask, acc[j]);
}

// y_j[c0 + 0..w) += sum over the live r of h_j[r] * b[r][c0 + 0..w) (w <= 32) for M rows; h16: the block's h
// rounded to bf16, row stride R; y rows bf16, rounded once.
template <int M>
PAGEDLLM_LORA_BF16 void expand_tile_bf16(const uint16_t* h16, int64_t R, const uint16_t* b, int64_t N,
                                         int64_t bands, int64_t max_rank, int64_t rank, const int32_t* cols,
                                         uint16_t* const* yrows, int64_t c0, int64_t w) {
  const __mmask16 m0 = static_cast<__mmask16>(w >= 16 ? 0xFFFFu : (1u << w) - 1u);
  const __mmask16 m1 = static_cast<__mmask16>(w <= 16 ? 0u : w >= 32 ? 0xFFFFu : (1u << (w - 16)) - 1u);
  __m512 acc[M][2];
  for (int j = 0; j < M; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  for (int64_t band = 0; band < bands; ++band) {
    if (!band_reaches(cols, band, c0, w)) continue;
    const int64_t end = band * max_rank + rank;
    for (int64_t r = band * max_rank; r < end; r += 2) {
      const bool two = r + 1 < end;
      const uint16_t* b0 = b + r * N + c0;
      const uint16_t* b1 = two ? b0 + N : nullptr;
      const __m512bh p0 = (__m512bh)pair_rows(b0, b1, m0);
      const __m512bh p1 = (__m512bh)pair_rows(b0 + 16, b1 == nullptr ? nullptr : b1 + 16, m1);
      for (int j = 0; j < M; ++j) {
        const uint16_t* hj = h16 + j * R + r;
        const __m512bh hp = (__m512bh)_mm512_set1_epi32(two ? load_pair(hj) : static_cast<int32_t>(hj[0]));
        acc[j][0] = _mm512_dpbf16_ps(acc[j][0], hp, p0);
        acc[j][1] = _mm512_dpbf16_ps(acc[j][1], hp, p1);
      }
    }
  }
  for (int j = 0; j < M; ++j) {
    uint16_t* yr = yrows[j] + c0;
    const __mmask16 masks[2] = {m0, m1};
    for (int half = 0; half < 2; ++half) {
      if (!masks[half]) continue;
      const __m512 old = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(masks[half], yr + 16 * half)), 16));
      const __m256i sum = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(old, acc[j][half]));
      _mm256_mask_storeu_epi16(yr + 16 * half, masks[half], sum);
    }
  }
}

// The whole term with the tiles above (bf16 rows, bf16 slots): h rounded to bf16 once per block.
void sgmv_bf16(uint16_t* y, int64_t y_stride, const uint16_t* x, int64_t x_stride, const uint16_t* a,
               const uint16_t* b, const int32_t* ranks, const int32_t* band_cols, int64_t max_rank, const Plan& plan,
               int64_t K, int64_t R, int64_t N) {
  const auto& blocks = plan.blocks;
  const auto& order = plan.order;
  const int64_t live = static_cast<int64_t>(order.size());
  const int64_t bands = R / max_rank;
  std::vector<float> h(static_cast<size_t>(live * R));
  std::vector<uint16_t> h16(static_cast<size_t>(live * R));
  auto shrink = [&](int64_t bi) {
    const Block& blk = blocks[bi];
    const uint16_t* xrows[kRows];
    for (int64_t j = 0; j < blk.count; ++j) xrows[j] = x + order[blk.first + j] * x_stride;
    const uint16_t* as = a + blk.slot * K * R;
    float* hb = h.data() + blk.first * R;
    with_rows(blk.count, [&]<int M>() {
      shrink_groups<M>(hb, R, max_rank, ranks[blk.slot], band_cols + blk.slot * bands * 2,
                       [&](int64_t g0, int64_t w) { shrink_tile_bf16<M>(xrows, K, as + g0, R, hb + g0, R, w); });
    });
    for (int64_t i = 0; i < blk.count * R; ++i) {
      c10::BFloat16 v;
      narrow(&v, hb[i]);
      h16[blk.first * R + i] = v.x;
    }
  };
  auto expand = [&](int64_t bi, int64_t n0, int64_t width) {
    const Block& blk = blocks[bi];
    const uint16_t* bs = b + blk.slot * R * N;
    uint16_t* yrows[kRows];
    for (int64_t j = 0; j < blk.count; ++j) yrows[j] = y + order[blk.first + j] * y_stride;
    with_rows(blk.count, [&]<int M>() {
      for (int64_t c0 = n0; c0 < n0 + width; c0 += kTile)
        expand_tile_bf16<M>(h16.data() + blk.first * R, R, bs, N, bands, max_rank, ranks[blk.slot],
                            band_cols + blk.slot * bands * 2, yrows, c0, std::min(kTile, n0 + width - c0));
    });
  };
  run_passes(plan, K, R, N, max_rank, shrink, expand);
}
#endif

template <typename TX, typename TY, typename TW>
void sgmv(TY* y, int64_t y_stride, const TX* x, int64_t x_stride, const TW* a, const TW* b,
          const int32_t* ranks, const int32_t* band_cols, int64_t max_rank, const int32_t* row_slots, int64_t T,
          int64_t S, int64_t K, int64_t R, int64_t N) {
  const Plan plan = plan_blocks(ranks, row_slots, T, S);
  const auto& blocks = plan.blocks;
  const auto& order = plan.order;
  const int64_t live = static_cast<int64_t>(order.size());
  if (live == 0) return;
#if defined(__x86_64__)
  if constexpr (std::is_same_v<TX, c10::BFloat16> && std::is_same_v<TW, c10::BFloat16>) {
    static const bool dot_bf16 = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
    if (dot_bf16) {
      sgmv_bf16(reinterpret_cast<uint16_t*>(y), y_stride, reinterpret_cast<const uint16_t*>(x), x_stride,
                reinterpret_cast<const uint16_t*>(a), reinterpret_cast<const uint16_t*>(b), ranks, band_cols,
                max_rank, plan, K, R, N);
      return;
    }
  }
#endif
  const int64_t bands = R / max_rank;
  std::vector<float> h(static_cast<size_t>(live * R));  // h of sorted row i at h[i * R]
  auto shrink = [&](int64_t bi) {  // the block's rows of x widened to float, then h = x @ A[s]
    thread_local std::vector<float> xf;
    xf.resize(static_cast<size_t>(kRows * K));
    const Block& blk = blocks[bi];
    for (int64_t j = 0; j < blk.count; ++j) {
      const TX* xr = x + order[blk.first + j] * x_stride;
      float* xj = xf.data() + j * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) xj[k] = widen(xr[k]);
    }
    const TW* as = a + blk.slot * K * R;
    float* hb = h.data() + blk.first * R;
    with_rows(blk.count, [&]<int M>() {
      shrink_groups<M>(hb, R, max_rank, ranks[blk.slot], band_cols + blk.slot * bands * 2,
                       [&](int64_t g0, int64_t w) {
        if (w == kLanes) shrink_tile<M, kLanes, TW>(xf.data(), K, as + g0, R, hb + g0, R, kLanes);
        else shrink_tile<M, 0, TW>(xf.data(), K, as + g0, R, hb + g0, R, w);
      });
    });
  };
  auto expand = [&](int64_t bi, int64_t n0, int64_t width) {  // y += h @ B[s]
    const Block& blk = blocks[bi];
    const TW* bs = b + blk.slot * R * N;
    const int64_t rank = ranks[blk.slot];
    const int32_t* cols = band_cols + blk.slot * bands * 2;
    const float* hb = h.data() + blk.first * R;
    TY* yrows[kRows];
    for (int64_t j = 0; j < blk.count; ++j) yrows[j] = y + order[blk.first + j] * y_stride;
    with_rows(blk.count, [&]<int M>() {
      for (int64_t c0 = n0; c0 < n0 + width; c0 += kTile) {
        const int64_t w = std::min(kTile, n0 + width - c0);
        if (w == kTile)
          expand_tile<M, kTile, TW>(hb, R, bs + c0, N, bands, max_rank, rank, cols, yrows, c0, kTile);
        else
          expand_tile<M, 0, TW>(hb, R, bs + c0, N, bands, max_rank, rank, cols, yrows, c0, w);
      }
    });
  };
  run_passes(plan, K, R, N, max_rank, shrink, expand);
}

template <typename F>
void with_row_type(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == torch::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    f(float{});
  }
}

}  // namespace

void lora_sgmv_(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a_slots,
                const torch::Tensor& b_slots, const torch::Tensor& slot_ranks, int64_t max_rank,
                const torch::Tensor& row_slots, const torch::Tensor& band_cols) {
  for (const auto* t : {&y, &x})
    TORCH_CHECK((t->scalar_type() == torch::kFloat32 || t->scalar_type() == torch::kBFloat16) && t->dim() == 2 &&
                    t->stride(1) == 1,
                "lora_sgmv_: y and x must be float32 or bfloat16 [T, C] with contiguous rows");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "lora_sgmv_: y and x must have one dtype");
  TORCH_CHECK((a_slots.scalar_type() == torch::kFloat32 || a_slots.scalar_type() == torch::kBFloat16) &&
                  b_slots.scalar_type() == a_slots.scalar_type() && a_slots.dim() == 3 && b_slots.dim() == 3 &&
                  a_slots.is_contiguous() && b_slots.is_contiguous(),
              "lora_sgmv_: a_slots [S, K, R] and b_slots [S, R, N] must be contiguous, both float32 or both bf16");
  const int64_t T = x.size(0), K = x.size(1), S = a_slots.size(0), R = a_slots.size(2), N = y.size(1);
  TORCH_CHECK(y.size(0) == T && a_slots.size(1) == K && b_slots.size(0) == S && b_slots.size(1) == R &&
                  b_slots.size(2) == N,
              "lora_sgmv_: shapes do not agree (y [T, N], x [T, K], A [S, K, R], B [S, R, N])");
  TORCH_CHECK(max_rank > 0 && R % max_rank == 0, "lora_sgmv_: R must be a multiple of max_rank");
  TORCH_CHECK(slot_ranks.scalar_type() == torch::kInt32 && slot_ranks.dim() == 1 && slot_ranks.size(0) == S &&
                  slot_ranks.is_contiguous(),
              "lora_sgmv_: slot_ranks must be int32 [S]");
  TORCH_CHECK(row_slots.scalar_type() == torch::kInt32 && row_slots.dim() == 1 && row_slots.size(0) == T &&
                  row_slots.is_contiguous(),
              "lora_sgmv_: row_slots must be int32 [T]");
  TORCH_CHECK(band_cols.scalar_type() == torch::kInt32 && band_cols.dim() == 3 && band_cols.size(0) == S &&
                  band_cols.size(1) == R / max_rank && band_cols.size(2) == 2 && band_cols.is_contiguous(),
              "lora_sgmv_: band_cols must be int32 [S, R / max_rank, 2]");
  const int32_t* ranks = slot_ranks.data_ptr<int32_t>();
  const int32_t* cols = band_cols.data_ptr<int32_t>();
  for (int64_t i = 0; i < band_cols.numel(); i += 2)
    TORCH_CHECK(0 <= cols[i] && cols[i] <= cols[i + 1] && cols[i + 1] <= N, "lora_sgmv_: band_cols entry ", i / 2,
                " is [", cols[i], ", ", cols[i + 1], "), not a range of 0..", N);
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(ranks[s] >= 0 && ranks[s] <= max_rank, "lora_sgmv_: slot ", s, " has rank ", ranks[s],
                " outside 0..", max_rank);
  with_row_type(x, [&](auto xe) {
    using TX = decltype(xe);
    with_row_type(a_slots, [&](auto we) {
      using TW = decltype(we);
      sgmv<TX, TX, TW>(y.data_ptr<TX>(), y.stride(0), x.data_ptr<TX>(), x.stride(0), a_slots.data_ptr<TW>(),
                       b_slots.data_ptr<TW>(), ranks, cols, max_rank, row_slots.data_ptr<int32_t>(), T, S, K, R, N);
    });
  });
}
