// y[M, N] = x[M, K] @ W^T (+ bias) with W packed once at load time into panels of 16 output columns.
//
// Why not BLAS: on the shapes of a decode step (M = 1..256, K and N in the hundreds to thousands) MKL
// re-packs the whole weight matrix on every call and scales C before accumulating; on the default model
// that was ~12% of a 200-sequence decode step. With the weight already in panel order, the inner kernel
// streams it straight from memory, one code path covers M = 1 (bound by reading the weights) to prefill
// chunks of thousands of rows, and the packed copy replaces the original (no extra memory).
//
// Packed layout: [ceil(N / 16), K, 16]; panel p holds W[16p .. 16p + 15, k] for every k, zero-padded past N.
// Each thread works on its own range of panels (its slice of the weights) for all rows; see panels_range
// for the cache blocking. The register tile is 6 rows x 16 columns.
#include "gemm_args.h"
#include "kernels.h"
#include "packed_panels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NR = 16;   // output columns per panel (two AVX2 registers)
constexpr int64_t MR = PACKED_MR;  // rows per register tile: 12 accumulators + 2 weight registers + 1 broadcast
constexpr int64_t KC = 256;  // K chunk: 16 KiB of a panel
constexpr int64_t X_BLOCK_BYTES = 256 * 1024;      // x rows per block: about half of a Zen 3 / Skylake L2
constexpr int64_t WEIGHTS_L3_BYTES = 8 << 20;       // a thread's panels up to this size stay in L3

#if defined(__AVX2__) && defined(__FMA__)
// A row's two accumulators at the start of a K chunk: bias (or zero) when first, else y's partial sums.
template <bool EDGE>
inline void load_acc(bool first, const float* bias, const float* y, __m256i mask0, __m256i mask1, __m256& c0,
                     __m256& c1) {
  const float* src = first ? bias : y;
  if (first && bias == nullptr) {
    c0 = c1 = _mm256_setzero_ps();
  } else {
    c0 = EDGE ? _mm256_maskload_ps(src, mask0) : _mm256_loadu_ps(src);
    c1 = EDGE ? _mm256_maskload_ps(src + 8, mask1) : _mm256_loadu_ps(src + 8);
  }
}

template <bool EDGE>
inline void store_acc(float* y, __m256i mask0, __m256i mask1, __m256 c0, __m256 c1) {
  if (EDGE) {
    _mm256_maskstore_ps(y, mask0, c0);
    _mm256_maskstore_ps(y + 8, mask1, c1);
  } else {
    _mm256_storeu_ps(y, c0);
    _mm256_storeu_ps(y + 8, c1);
  }
}

// One R x 16 tile of y over k in [0, kc): y_tile (+)= x_tile @ panel[0:kc, :]. The tile's x rows are either
// packed k-major (PACKED: a[k * MR + i], one stream for the broadcasts) or read in place (a[i * lda + k]).
// first: start from bias (or zero) instead of reading y. Edge panels (N % 16 != 0) use masked loads/stores.
// The accumulators are named variables, not an array: GCC 12 keeps a copy of a __m256 array in memory and
// stores every accumulator on every k step, which halved this loop's speed.
template <int R, bool EDGE, bool PACKED>
inline void tile(const float* a, int64_t lda, const float* panel, float* y, int64_t ldy, int64_t kc, bool first,
                 const float* bias, __m256i mask0, __m256i mask1) {
  static_assert(R >= 1 && R <= 6, "tiles have 1..6 rows");
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define PAGEDLLM_EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define PAGEDLLM_LOAD(i) \
  if constexpr (R > i) load_acc<EDGE>(first, bias, y + i * ldy, mask0, mask1, c##i##0, c##i##1);
#define PAGEDLLM_FMA(i)                                                                      \
  if constexpr (R > i) {                                                                     \
    const __m256 av = _mm256_broadcast_ss(PACKED ? a + k * MR + i : a + i * lda + k);        \
    c##i##0 = _mm256_fmadd_ps(av, b0, c##i##0);                                              \
    c##i##1 = _mm256_fmadd_ps(av, b1, c##i##1);                                              \
  }
#define PAGEDLLM_STORE(i) if constexpr (R > i) store_acc<EDGE>(y + i * ldy, mask0, mask1, c##i##0, c##i##1);
  PAGEDLLM_EACH_ROW(PAGEDLLM_LOAD)
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * NR), b1 = _mm256_loadu_ps(panel + k * NR + 8);
    PAGEDLLM_EACH_ROW(PAGEDLLM_FMA)
  }
  PAGEDLLM_EACH_ROW(PAGEDLLM_STORE)
#undef PAGEDLLM_STORE
#undef PAGEDLLM_FMA
#undef PAGEDLLM_LOAD
#undef PAGEDLLM_EACH_ROW
}

template <bool EDGE, bool PACKED>
inline void tile_rows(int64_t rows, const float* a, int64_t lda, const float* panel, float* y, int64_t ldy,
                      int64_t kc, bool first, const float* bias, __m256i mask0, __m256i mask1) {
  switch (rows) {
    case 6: tile<6, EDGE, PACKED>(a, lda, panel, y, ldy, kc, first, bias, mask0, mask1); break;
    case 5: tile<5, EDGE, PACKED>(a, lda, panel, y, ldy, kc, first, bias, mask0, mask1); break;
    case 4: tile<4, EDGE, PACKED>(a, lda, panel, y, ldy, kc, first, bias, mask0, mask1); break;
    case 3: tile<3, EDGE, PACKED>(a, lda, panel, y, ldy, kc, first, bias, mask0, mask1); break;
    case 2: tile<2, EDGE, PACKED>(a, lda, panel, y, ldy, kc, first, bias, mask0, mask1); break;
    default: tile<1, EDGE, PACKED>(a, lda, panel, y, ldy, kc, first, bias, mask0, mask1); break;
  }
}
#endif

// Portable fallback for one panel over rows [m0, m1) and k in [k0, k1).
void panel_scalar(const float* x, int64_t ldx, const float* panel, float* y, int64_t ldy, int64_t m0, int64_t m1,
                  int64_t k0, int64_t k1, int64_t cols, bool first, const float* bias) {
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t j = 0; j < cols; ++j) {
      float s = first ? (bias != nullptr ? bias[j] : 0.f) : y[m * ldy + j];
      for (int64_t k = k0; k < k1; ++k) s += x[m * ldx + k] * panel[k * NR + j];
      y[m * ldy + j] = s;
    }
  }
}

}  // namespace

int64_t packed_gemm_k_chunk(int64_t K) {
  // Even K chunks of at most KC, so no chunk is a sliver.
  const int64_t nk = std::max<int64_t>(1, (K + KC - 1) / KC);
  return (K + nk - 1) / nk;
}

int64_t packed_gemm_row_block(int64_t K) { return std::max<int64_t>(MR, X_BLOCK_BYTES / (4 * K) / MR * MR); }

void pack_x_tiles(const float* x, int64_t ldx, int64_t rows, int64_t K, float* dst) {
  for (int64_t m = 0; m < rows; m += MR) {
    float* t = dst + m * K;
    const int64_t r = std::min(MR, rows - m);
    for (int64_t i = 0; i < r; ++i)
      for (int64_t k = 0; k < K; ++k) t[k * MR + i] = x[(m + i) * ldx + k];
  }
}

// All K chunks of one panel for rows [0, rows) of x packed into k-major tiles `xt` ([tile][K][MR], see
// pack_x_tiles). The panel's MC x 16 outputs stay in L1/L2 across its K chunks, so y is written once.
void panel_rows_packed_x(const float* xt, int64_t rows, const float* panel, int64_t K, int64_t kc_even,
                         int64_t cols, const float* bias, float* y, int64_t ldy) {
  for (int64_t k0 = 0; k0 < K; k0 += kc_even) {
    const int64_t kc = std::min(kc_even, K - k0);
    const bool first = k0 == 0;
    const float* pk = panel + k0 * NR;
    const float* b = first ? bias : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)), lane);
    const __m256i mask1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols) - 8), lane);
    for (int64_t m = 0; m < rows; m += MR) {
      const int64_t r = std::min(MR, rows - m);
      const float* a = xt + m * K + k0 * MR;
      if (cols == NR) tile_rows<false, true>(r, a, MR, pk, y + m * ldy, ldy, kc, first, b, mask0, mask1);
      else tile_rows<true, true>(r, a, MR, pk, y + m * ldy, ldy, kc, first, b, mask0, mask1);
    }
#else
    for (int64_t m = 0; m < rows; ++m) {
      const float* a = xt + (m / MR) * K * MR + (m % MR);
      for (int64_t j = 0; j < cols; ++j) {
        float s = first ? (b != nullptr ? b[j] : 0.f) : y[m * ldy + j];
        for (int64_t k = k0; k < k0 + kc; ++k) s += a[k * MR] * panel[k * NR + j];
        y[m * ldy + j] = s;
      }
    }
#endif
  }
}

namespace {

// All rows of panels [p0, p1), `packed` pointing at panel p0. Loop order: row block (its x rows stay in L2
// across panels) -> panel -> K chunk (one panel chunk stays in L1 across the block's row tiles) -> 6-row tile.
// A panel's output columns for the row block (MC x 16) stay in L1/L2 across the K chunks, so y is written once.
void panels_range(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t ldy,
                  int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  const int64_t kc_even = packed_gemm_k_chunk(K);
  // Even row blocks whose x rows (all of K) fit in about half of L2, in whole tiles. Every row block
  // re-reads this thread's panels, so when those are too big to stay in L3 (an LM head), x is read from
  // L3 instead and the weights are streamed from memory once.
  const bool weights_fit_l3 = (p1 - p0) * K * NR * 4 <= WEIGHTS_L3_BYTES;
  const int64_t mc_max = weights_fit_l3 ? packed_gemm_row_block(K) : M;
  const int64_t nm = (M + mc_max - 1) / mc_max;
  const int64_t mc_even = ((M + nm - 1) / nm + MR - 1) / MR * MR;
  // Past two tiles of rows, this thread copies each row block of x into 6-row tiles, k-major:
  // [tile][K][MR] (short tiles padded), so each tile's broadcasts read one stream instead of six.
  const bool pack_x = M > 2 * MR;
  thread_local std::vector<float> xbuf;
  if (pack_x) xbuf.resize(static_cast<size_t>(std::min(mc_even, (M + MR - 1) / MR * MR) * K));
  for (int64_t m0 = 0; m0 < M; m0 += mc_even) {
    const int64_t m1 = std::min(M, m0 + mc_even);
    if (pack_x) pack_x_tiles(x + m0 * ldx, ldx, m1 - m0, K, xbuf.data());
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
      const float* panel_p = packed + (p - p0) * K * NR;
      const float* bp = bias != nullptr ? bias + n0 : nullptr;
      if (pack_x) {
        panel_rows_packed_x(xbuf.data(), m1 - m0, panel_p, K, kc_even, cols, bp, y + m0 * ldy + n0, ldy);
        continue;
      }
      for (int64_t k0 = 0; k0 < K; k0 += kc_even) {
        const int64_t kc = std::min(kc_even, K - k0);
        const bool first = k0 == 0;
        const float* panel = panel_p + k0 * NR;
        const float* b = first ? bp : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i mask0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols)), lane);
        const __m256i mask1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols) - 8), lane);
        for (int64_t m = m0; m < m1; m += MR) {
          const int64_t rows = std::min(MR, m1 - m);
          const float* a = x + m * ldx + k0;
          float* yt = y + m * ldy + n0;
          if (cols == NR) tile_rows<false, false>(rows, a, ldx, panel, yt, ldy, kc, first, b, mask0, mask1);
          else tile_rows<true, false>(rows, a, ldx, panel, yt, ldy, kc, first, b, mask0, mask1);
        }
        continue;
#endif
        panel_scalar(x, ldx, panel - k0 * NR, y + n0, ldy, m0, m1, k0, k0 + kc, cols, first, b);
      }
    }
  }
}

}  // namespace

torch::Tensor packed_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                          const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.scalar_type() == torch::kFloat32 &&
              packed.is_contiguous(), "packed weight must be contiguous float32 [ceil(N/16), K, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " columns, the packed weight ", packed.size(1));
  TORCH_CHECK(K > 0, "x has no columns");
  TORCH_CHECK(N > 0 && (N + NR - 1) / NR == packed.size(0), "out_features ", N, " does not match the packing");
  // Rows may be strided (a view into a wider tensor) but each row must be contiguous.
  const torch::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  torch::Tensor bc;
  const float* b = gemm_bias(bias, N, bc);
  torch::Tensor y = gemm_output(out, M, N, x.options());
  if (M == 0) return y;
  const int64_t ldy = y.stride(0);
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t panels = packed.size(0);
  // Each thread takes a contiguous range of panels (its slice of the weights) and all rows; at least
  // ~256k multiply-adds per thread, so tiny matmuls stay on one.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, M * K * NR));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    panels_range(xp, ldx, wp + p0 * K * NR, b, yp, ldy, M, K, N, p0, p1);
  });
  return y;
}
