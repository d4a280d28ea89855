// The multi-LoRA term of one linear layer in one call (Punica's segmented gather matmul, SGMV, on the CPU):
// y[t] += (x[t] @ A[s]) @ B[s] for every row t whose adapter slot s = row_slots[t] is >= 0; rows of slot -1 (the
// base model) are left as they are.
//
// The rows are grouped by slot inside the kernel (a counting sort of row_slots), so the caller passes one int32 per
// row and no plan: the same call, recorded once in a CPU step graph, serves any mix of adapters at replay. Work is
// cut into blocks of up to kRows rows of one slot. Phase one (shrink) computes h = x @ A for each block, reading
// A's row k once for all of the block's rows; phase two (expand) adds h @ B into y by column chunks, reading each
// row of B once per block and chunk. Both phases are thread-parallel (blocks, then block x column chunk): a batch-1
// decode still spreads B, the bigger matrix, over the cores.
//
// A [S, K, R] and B [S, R, N] are float32 slot buffers, R = bands * max_rank: band b of a fused layer (q/k/v,
// gate/up) lives in columns [b * max_rank, b * max_rank + slot_ranks[s]) of A and the same rows of B; the columns
// past an adapter's rank are zero and skipped. The scaling is folded into B. Arithmetic is float32; a bf16 y gets
// one rounding. Each row's sums run in a fixed order whatever the batch, so a request's result never depends on
// the rows beside it.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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

template <typename TX, typename TY>
void sgmv(TY* y, int64_t y_stride, const TX* x, int64_t x_stride, const float* a, const float* b,
          const int32_t* ranks, int64_t max_rank, const int32_t* row_slots, int64_t T, int64_t S, int64_t K,
          int64_t R, int64_t N) {
  // Rows by slot (counting sort: stable, so rows stay in batch order within a slot).
  std::vector<int64_t> starts(static_cast<size_t>(S) + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = row_slots[t];
    TORCH_CHECK(s < S, "lora_sgmv_: row ", t, " names slot ", s, " of ", S);
    if (s >= 0 && ranks[s] > 0) ++starts[s + 1];
  }
  for (int64_t s = 0; s < S; ++s) starts[s + 1] += starts[s];
  const int64_t live = starts[S];
  if (live == 0) return;
  std::vector<int64_t> order(static_cast<size_t>(live));
  {
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t t = 0; t < T; ++t) {
      const int32_t s = row_slots[t];
      if (s >= 0 && ranks[s] > 0) order[next[s]++] = t;
    }
  }
  std::vector<Block> blocks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = starts[s]; i < starts[s + 1]; i += kRows)
      blocks.push_back({s, i, std::min(kRows, starts[s + 1] - i)});
  const int64_t bands = R / max_rank;
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  const int64_t col_chunks = (N + kCols - 1) / kCols;
  std::vector<float> h(static_cast<size_t>(live * R));  // h of sorted row i at h[i * R]

  // A tiny term runs on the calling thread: waking the pool costs more than it saves.
  const int64_t flops = live * (K + N) * std::min<int64_t>(R, bands * 16);
  const int64_t grain = flops < (1 << 15) ? num_blocks * col_chunks : 1;

  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {  // shrink: h = x @ A[s]
    for (int64_t bi = begin; bi < end; ++bi) {
      const Block& blk = blocks[bi];
      const float* as = a + blk.slot * K * R;
      const int64_t rank = ranks[blk.slot];
      float* hb = h.data() + blk.first * R;
      std::memset(hb, 0, sizeof(float) * blk.count * R);
      for (int64_t k = 0; k < K; ++k) {
        const float* ak = as + k * R;
        for (int64_t j = 0; j < blk.count; ++j) {
          const float xv = widen(x[order[blk.first + j] * x_stride + k]);
          float* hj = hb + j * R;
          for (int64_t band = 0; band < bands; ++band) {
            const int64_t lo = band * max_rank;
#pragma omp simd
            for (int64_t r = lo; r < lo + rank; ++r) hj[r] += xv * ak[r];
          }
        }
      }
    }
  });
  at::parallel_for(0, num_blocks * col_chunks, grain, [&](int64_t begin, int64_t end) {  // expand: y += h @ B[s]
    float acc[kRows][kCols];
    for (int64_t unit = begin; unit < end; ++unit) {
      const Block& blk = blocks[unit / col_chunks];
      const int64_t n0 = (unit % col_chunks) * kCols, width = std::min(kCols, N - n0);
      const float* bs = b + blk.slot * R * N + n0;
      const int64_t rank = ranks[blk.slot];
      const float* hb = h.data() + blk.first * R;
      for (int64_t j = 0; j < blk.count; ++j) std::fill(acc[j], acc[j] + width, 0.f);
      for (int64_t band = 0; band < bands; ++band)
        for (int64_t r = band * max_rank; r < band * max_rank + rank; ++r) {
          const float* br = bs + r * N;
          for (int64_t j = 0; j < blk.count; ++j) {
            const float hv = hb[j * R + r];
#pragma omp simd
            for (int64_t c = 0; c < width; ++c) acc[j][c] += hv * br[c];
          }
        }
      for (int64_t j = 0; j < blk.count; ++j) {
        TY* yr = y + order[blk.first + j] * y_stride + n0;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) narrow(yr + c, widen(yr[c]) + acc[j][c]);
      }
    }
  });
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
                const torch::Tensor& row_slots) {
  for (const auto* t : {&y, &x})
    TORCH_CHECK((t->scalar_type() == torch::kFloat32 || t->scalar_type() == torch::kBFloat16) && t->dim() == 2 &&
                    t->stride(1) == 1,
                "lora_sgmv_: y and x must be float32 or bfloat16 [T, C] with contiguous rows");
  TORCH_CHECK(a_slots.scalar_type() == torch::kFloat32 && b_slots.scalar_type() == torch::kFloat32 &&
                  a_slots.dim() == 3 && b_slots.dim() == 3 && a_slots.is_contiguous() && b_slots.is_contiguous(),
              "lora_sgmv_: a_slots [S, K, R] and b_slots [S, R, N] must be contiguous float32");
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
  const int32_t* ranks = slot_ranks.data_ptr<int32_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(ranks[s] >= 0 && ranks[s] <= max_rank, "lora_sgmv_: slot ", s, " has rank ", ranks[s],
                " outside 0..", max_rank);
  with_row_type(x, [&](auto xe) {
    using TX = decltype(xe);
    with_row_type(y, [&](auto ye) {
      using TY = decltype(ye);
      sgmv<TX, TY>(y.data_ptr<TY>(), y.stride(0), x.data_ptr<TX>(), x.stride(0), a_slots.data_ptr<float>(),
                   b_slots.data_ptr<float>(), ranks, max_rank, row_slots.data_ptr<int32_t>(), T, S, K, R, N);
    });
  });
}
