// bfloat16: y[M, N] = x[M, K] @ W^T (+ bias), x, W, bias and y in bf16, sums in float32, for CPUs with
// AVX-512 BF16 (vdpbf16ps: 32 bf16 x bf16 products summed pairwise into 16 float32 lanes per instruction).
//
// Why not oneDNN's bf16 matmul: for few rows (a decode step) the product is bound by reading the weights, and
// oneDNN's packed bf16 path read them at ~8 GB/s on an AMD EPYC Zen 4 (SmolLM2-135M: 35 ms per token at batch 1,
// 270 MB of weights). Here the weight is packed once at load into panels of 16 output columns and pairs of k,
// [ceil(N / 16), K / 2, 16, 2] bf16: one 64-byte row per pair of k, exactly what one vdpbf16ps reads, so a panel
// streams from memory in order. The autotuner (kernel_choice.py) times this against oneDNN per bucket of rows.
//
// A tile is R <= 8 rows x 16 columns. A single row splits k into four interleaved partial sums, so the
// dot-product latency (a dependency chain per accumulator) does not bound the weight stream.
//
// y is bf16, or float32 where `out` is (the float32 sums as they are: a quantized weight's dense bf16 copy
// (dense_copy.py) keeps float32 activations and logits).
#include "cpu_features.h"
#include "gemm_args.h"
#include "kernels.h"
#include "moe_gemm.h"
#include "moe_items.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NR = 16;  // output columns per panel
constexpr int MR = 8;       // rows per register tile

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void store_sum(float s, uint16_t* y);
inline void store_sum(float s, float* y) { *y = s; }

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as vcvtneps2bf16
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__x86_64__)
#define PAGEDLLM_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Rows [0, R) of one panel: y_r[0:cols] = bias + sum_k x_r[k] W[k]. x rows are bf16 pairs read as 32-bit lanes.
template <int R, class OutT>
PAGEDLLM_BF16_TARGET void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t kp,
                                    const uint16_t* bias, OutT* y, int64_t ldy, __mmask16 mask) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  if constexpr (R == 1) {
    // Four independent chains over k so the loads, not the dot products' latency, set the pace.
    __m512 a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    const uint32_t* xr = reinterpret_cast<const uint32_t*>(x);
    int64_t j = 0;
    for (; j + 4 <= kp; j += 4) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (j + 32) * 2 * NR), _MM_HINT_T0);
      acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[j])),
                                (__m512bh)_mm512_loadu_si512(panel + j * 2 * NR));
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[j + 1])),
                            (__m512bh)_mm512_loadu_si512(panel + (j + 1) * 2 * NR));
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[j + 2])),
                            (__m512bh)_mm512_loadu_si512(panel + (j + 2) * 2 * NR));
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[j + 3])),
                            (__m512bh)_mm512_loadu_si512(panel + (j + 3) * 2 * NR));
    }
    for (; j < kp; ++j)
      acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[j])),
                                (__m512bh)_mm512_loadu_si512(panel + j * 2 * NR));
    acc[0] = _mm512_add_ps(_mm512_add_ps(acc[0], a1), _mm512_add_ps(a2, a3));
  } else {
#pragma GCC unroll 2
    for (int64_t j = 0; j < kp; ++j) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + j * 2 * NR);
      for (int i = 0; i < R; ++i) {
        const uint32_t pair = reinterpret_cast<const uint32_t*>(x + i * ldx)[j];
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), w);
      }
    }
  }
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr) {
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias);
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  for (int i = 0; i < R; ++i) {
    if constexpr (std::is_same_v<OutT, float>) {
      _mm512_mask_storeu_ps(y + i * ldy, mask, _mm512_add_ps(acc[i], b));
    } else {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i], b));
      _mm256_mask_storeu_epi16(y + i * ldy, mask, out);
    }
  }
}

template <class OutT>
PAGEDLLM_BF16_TARGET void panels_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias,
                                      OutT* y, int64_t ldy, int64_t M, int64_t K, int64_t N, int64_t p0,
                                      int64_t p1) {
  const int64_t kp = K / 2;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    const uint16_t* panel = packed + p * kp * 2 * NR;
    const uint16_t* bp = bias != nullptr ? bias + n0 : nullptr;
    for (int64_t m = 0; m < M; m += MR) {
      const uint16_t* xm = x + m * ldx;
      OutT* ym = y + m * ldy + n0;
      switch (std::min<int64_t>(MR, M - m)) {
        case 8: tile_bf16<8>(xm, ldx, panel, kp, bp, ym, ldy, mask); break;
        case 7: tile_bf16<7>(xm, ldx, panel, kp, bp, ym, ldy, mask); break;
        case 6: tile_bf16<6>(xm, ldx, panel, kp, bp, ym, ldy, mask); break;
        case 5: tile_bf16<5>(xm, ldx, panel, kp, bp, ym, ldy, mask); break;
        case 4: tile_bf16<4>(xm, ldx, panel, kp, bp, ym, ldy, mask); break;
        case 3: tile_bf16<3>(xm, ldx, panel, kp, bp, ym, ldy, mask); break;
        case 2: tile_bf16<2>(xm, ldx, panel, kp, bp, ym, ldy, mask); break;
        default: tile_bf16<1>(xm, ldx, panel, kp, bp, ym, ldy, mask); break;
      }
    }
  }
}
#endif

// Portable C++ (tests, and any CPU without AVX-512 BF16): float32 sums of the exact bf16 products.
template <class OutT>
void panels_generic(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias, OutT* y,
                    int64_t ldy, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  const int64_t kp = K / 2;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
    const uint16_t* panel = packed + p * kp * 2 * NR;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t c = 0; c < cols; ++c) {
        float s = 0.f;
        for (int64_t j = 0; j < kp; ++j)
          s += bf16_to_float(x[m * ldx + 2 * j]) * bf16_to_float(panel[(j * NR + c) * 2]) +
               bf16_to_float(x[m * ldx + 2 * j + 1]) * bf16_to_float(panel[(j * NR + c) * 2 + 1]);
        if (bias != nullptr) s += bf16_to_float(bias[n0 + c]);
        store_sum(s, y + m * ldy + n0 + c);
      }
    }
  }
}

inline void store_sum(float s, uint16_t* y) { *y = float_to_bf16(s); }

template <class OutT>
void run_panels(bool generic, const uint16_t* xp, int64_t ldx, const uint16_t* wp, const uint16_t* b, OutT* yp,
                int64_t ldy, int64_t M, int64_t K, int64_t N, int64_t panels) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, M * K * NR));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
#if defined(__x86_64__)
    if (!generic) {
      panels_bf16<OutT>(xp, ldx, wp, b, yp, ldy, M, K, N, p0, p1);
      return;
    }
#endif
    panels_generic<OutT>(xp, ldx, wp, b, yp, ldy, M, K, N, p0, p1);
  });
}

}  // namespace

bool bf16_gemm_supported() {
#if defined(__x86_64__)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

torch::Tensor bf16_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                        const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                        bool generic) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be bfloat16 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == NR && packed.size(3) == 2 &&
              packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous(),
              "packed weight must be contiguous bfloat16 [ceil(N/16), K/2, 16, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % 2 == 0 && packed.size(1) * 2 == K, "x has ", K, " columns, the packed weight ",
              packed.size(1) * 2, " (K must be even)");
  TORCH_CHECK(N > 0 && (N + NR - 1) / NR == packed.size(0), "out_features ", N, " does not match the packing");
  TORCH_CHECK(generic || bf16_gemm_supported(), "bf16_gemm: this CPU has no AVX-512 BF16");
  const torch::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K && x.stride(0) % 2 == 0 ? x : x.contiguous();
  torch::Tensor bc;
  const uint16_t* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(torch::kBFloat16).contiguous();
    TORCH_CHECK(bc.numel() == N, "bias must have ", N, " elements");
    b = reinterpret_cast<const uint16_t*>(bc.data_ptr<at::BFloat16>());
  }
  torch::Tensor y;
  if (out.has_value() && out->defined()) {
    y = *out;
    TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N &&
                (y.scalar_type() == torch::kBFloat16 || y.scalar_type() == torch::kFloat32) &&
                y.stride(1) == 1 && y.stride(0) >= N, "out must be bfloat16 or float32 [M, N] with contiguous rows");
  } else {
    y = torch::empty({M, N}, x.options());
  }
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t ldx = xc.stride(0), ldy = y.stride(0), panels = packed.size(0);
  if (y.scalar_type() == torch::kFloat32) {
    run_panels(generic, xp, ldx, wp, b, y.data_ptr<float>(), ldy, M, K, N, panels);
  } else {
    run_panels(generic, xp, ldx, wp, b, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), ldy, M, K, N,
               panels);
  }
  return y;
}

// The experts of a MoE layer in bf16 (moe_gemm.h): rows [ends[e-1], ends[e]) of x times expert e's panels, each
// work item (expert, rows, range of panels; moe_items.h) running the tiles above on its expert's rows.
torch::Tensor moe_bf16_gemm(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& ends,
                            int64_t out_features, const std::optional<torch::Tensor>& out, bool generic) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be bfloat16 [R, K]");
  TORCH_CHECK(packed.dim() == 5 && packed.size(3) == NR && packed.size(4) == 2 &&
              packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous(),
              "packed experts must be contiguous bfloat16 [E, ceil(N/16), K/2, 16, 2]");
  const int64_t R = x.size(0), K = x.size(1), N = out_features, E = packed.size(0), P = packed.size(1);
  TORCH_CHECK(K % 2 == 0 && packed.size(2) * 2 == K, "x has ", K, " columns, the packed experts ", packed.size(2) * 2);
  TORCH_CHECK(N > 0 && (N + NR - 1) / NR == P, "out_features ", N, " does not match the packing");
  TORCH_CHECK(generic || bf16_gemm_supported(), "moe_bf16_gemm: this CPU has no AVX-512 BF16");
  TORCH_CHECK(ends.size(0) == E, "ends has ", ends.size(0), " experts, the packed weights ", E);
  const std::vector<moe_items::Item> items = moe_items::expert_items(ends, R, P, K, int64_t{1} << 18);
  const torch::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K && x.stride(0) % 2 == 0 ? x : x.contiguous();
  torch::Tensor y = gemm_output(out, R, N, x.options());
  if (R == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldx = xc.stride(0), ldy = y.stride(0), expert_elems = P * (K / 2) * NR * 2;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const moe_items::Item& it = items[i];
      const uint16_t* x0 = xp + it.row0 * ldx;
      const uint16_t* w = wp + it.expert * expert_elems;
      uint16_t* y0 = yp + it.row0 * ldy;
#if defined(__x86_64__)
      if (!generic) {
        panels_bf16<uint16_t>(x0, ldx, w, nullptr, y0, ldy, it.rows, K, N, it.p0, it.p1);
        continue;
      }
#endif
      panels_generic<uint16_t>(x0, ldx, w, nullptr, y0, ldy, it.rows, K, N, it.p0, it.p1);
    }
  });
  return y;
}
