// W8A8: y[M, N] = x[M, K] @ (scale * int8 W)^T (+ bias) with x quantized per row to int8 at run time
// (dynamic per-token scales) and the products summed in int32 by AVX-512 VNNI (vpdpbusd: 64 u8 x s8
// multiply-adds per instruction, 4x an fp32 FMA's 16). Used for many rows (prefill, large batches), where
// the matmul is compute-bound; it reads the same int8 panels [P, K, 16] as the weight-only q8 kernel, with
// one scale per output column.
//
// AVX2 without VNNI has no such gain (u8 x s8 pairs need sign fix-ups, maddubs + madd + add: as many
// instructions per multiply-add as fp32 FMAs), so only VNNI CPUs run this kernel; callers use the
// weight-only path elsewhere.
//
// vpdpbusd multiplies unsigned by signed bytes: x is stored as xq + 128 (u8) and 128 * sum_k W[n, k] is
// subtracted at the end. Each panel is regrouped per call into k-quads [ceil(K/4), 16, 4] (4 consecutive k
// of one column in a 32-bit lane), zero-padded past K.
#include "cpu_features.h"
#include "gemm_args.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NR = 16;
constexpr int MR = 8;

// Per row: scale = max|x| / 127, xq = round(x / scale) + 128 as u8 (K padded to a multiple of 4 with 128).
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, uint8_t* xq, float* sx) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = x + m * ldx;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(r[k]));
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      const float inv = 1.f / s;
      uint8_t* q = xq + m * Kp;
      for (int64_t k = 0; k < K; ++k) q[k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(r[k] * inv)) + 128);
      for (int64_t k = K; k < Kp; ++k) q[k] = 128;
      sx[m] = s;
    }
  });
}

#if defined(__x86_64__)
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void vnni_tile(
    const uint8_t* xq, int64_t Kp, const int8_t* quads, const int32_t* colsum, const float* sx, const float* sw,
    float* tmp) {
  __m512i acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_si512();
  const int64_t nq = Kp / 4;
#pragma GCC unroll 4
  for (int64_t q = 0; q < nq; ++q) {
    const __m512i w = _mm512_loadu_si512(quads + q * 64);
    for (int i = 0; i < R; ++i) {
      int32_t xv;
      std::memcpy(&xv, xq + i * Kp + q * 4, 4);
      acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(xv), w);
    }
  }
  const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(colsum), 7);  // 128 * sum_k W
  const __m512 swv = _mm512_loadu_ps(sw);
  for (int i = 0; i < R; ++i) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], corr));
    _mm512_storeu_ps(tmp + i * NR, _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(sx[i])), swv));
  }
}

using VnniTile = void (*)(const uint8_t*, int64_t, const int8_t*, const int32_t*, const float*, const float*, float*);
const VnniTile kVnniTiles[MR] = {vnni_tile<1>, vnni_tile<2>, vnni_tile<3>, vnni_tile<4>,
                                 vnni_tile<5>, vnni_tile<6>, vnni_tile<7>, vnni_tile<8>};
#endif

// Panel [K, 16] -> k-quads [Kp/4, 16, 4] (zero-padded) and per-column sums of the weights.
void regroup_panel(const int8_t* panel, int64_t K, int64_t Kp, int8_t* quads, int32_t* colsum) {
  std::fill(colsum, colsum + NR, 0);
  for (int64_t k = 0; k < Kp; ++k) {
    for (int j = 0; j < NR; ++j) {
      const int8_t v = k < K ? panel[k * NR + j] : 0;
      quads[(k / 4) * 64 + j * 4 + (k % 4)] = v;
      colsum[j] += v;
    }
  }
}

}  // namespace

bool w8a8_supported() { return cpu_has_vnni512(); }

torch::Tensor w8a8_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                        int64_t out_features, const std::optional<torch::Tensor>& bias,
                        const std::optional<torch::Tensor>& out) {
  TORCH_CHECK(cpu_has_vnni512(), "w8a8_gemm needs AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = (N + NR - 1) / NR;
  TORCH_CHECK(K > 0 && N > 0, "empty matmul");
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == torch::kInt8 && qweight.dim() == 3 &&
              qweight.size(0) == P && qweight.size(1) == K && qweight.size(2) == NR,
              "qweight must be contiguous int8 [P, K, 16]");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == P * NR,
              "scales must be float32 [P, 1, 16] (one per output column)");
  const torch::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  torch::Tensor bc;
  const float* b = gemm_bias(bias, N, bc);
  torch::Tensor y = gemm_output(out, M, N, x.options());
  if (M == 0) return y;
#if defined(__x86_64__)
  const int64_t Kp = (K + 3) / 4 * 4;
  std::vector<uint8_t> xq(static_cast<size_t>(M * Kp));
  std::vector<float> sx(static_cast<size_t>(M));
  quantize_rows(xc.data_ptr<float>(), xc.stride(0), M, K, Kp, xq.data(), sx.data());
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* sw = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, M * K * NR));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<int8_t> quads;
    quads.resize(static_cast<size_t>(Kp * NR));
    alignas(64) int32_t colsum[NR];
    float tmp[MR * NR];
    // Row blocks of x (u8, all of K) of ~128 KiB stay in L2 across this thread's panels.
    const int64_t mblock = std::max<int64_t>(MR, (128 * 1024) / Kp / MR * MR);
    for (int64_t mb = 0; mb < M; mb += mblock) {
      const int64_t me = std::min(M, mb + mblock);
      for (int64_t p = p0; p < p1; ++p) {
        regroup_panel(w + p * K * NR, K, Kp, quads.data(), colsum);
        const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
        for (int64_t m = mb; m < me; m += MR) {
          const int rows = static_cast<int>(std::min<int64_t>(MR, me - m));
          kVnniTiles[rows - 1](xq.data() + m * Kp, Kp, quads.data(), colsum, sx.data() + m, sw + n0, tmp);
          for (int i = 0; i < rows; ++i) {
            float* yr = yp + (m + i) * ldy + n0;
            for (int64_t j = 0; j < cols; ++j) yr[j] = tmp[i * NR + j] + (b != nullptr ? b[n0 + j] : 0.f);
          }
        }
      }
    }
  });
#endif
  return y;
}
