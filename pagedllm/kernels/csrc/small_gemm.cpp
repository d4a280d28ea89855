// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for M <= 8 rows (decode steps of a few requests).
//
// At small M a matmul is bound by reading the weights. BLAS libraries handle M = 1 passably but fall off a
// cliff at M = 2..8 (each extra row costs nearly a whole extra weight pass); here each weight row is read
// once for all M input rows, with the input rows kept in cache, so M = 8 costs about what M = 1 does.
#include "kernels.h"

#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
#endif

// Rows n0..n1 of the output; R weight rows at a time so that M * R accumulators keep the FMA units busy.
template <int M, int R>
void rows_range(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n0,
                int64_t n1) {
  int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t K8 = K - K % 8;
  for (; n + R <= n1; n += R) {
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
      for (int r = 0; r < R; ++r) {
        const __m256 wv = _mm256_loadu_ps(w + (n + r) * K + k);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* wr = w + (n + r) * K;
      for (int m = 0; m < M; ++m) {
        float s = hsum(acc[r][m]);
        for (int64_t k = K8; k < K; ++k) s += x[m * K + k] * wr[k];
        y[m * N + n + r] = s + (bias ? bias[n + r] : 0.f);
      }
    }
  }
#endif
  for (; n < n1; ++n) {
    const float* wr = w + n * K;
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * wr[k];
      y[m * N + n] = s + (bias ? bias[n] : 0.f);
    }
  }
}

template <int M>
void run(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N) {
  constexpr int R = M == 1 ? 4 : (M <= 4 ? 2 : 1);
  // Contiguous row ranges per thread: each thread streams its own slice of the weight matrix.
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) { rows_range<M, R>(x, w, bias, y, K, N, n0, n1); });
}

}  // namespace

torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& weight,
                         const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "small_gemm takes 1..8 rows, got ", M);
  const torch::Tensor xc = x.contiguous();
  const float* b = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == torch::kFloat32 && bc.numel() == N, "bias must be float32 [N]");
    b = bc.data_ptr<float>();
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: run<1>(xp, wp, b, yp, K, N); break;
    case 2: run<2>(xp, wp, b, yp, K, N); break;
    case 3: run<3>(xp, wp, b, yp, K, N); break;
    case 4: run<4>(xp, wp, b, yp, K, N); break;
    case 5: run<5>(xp, wp, b, yp, K, N); break;
    case 6: run<6>(xp, wp, b, yp, K, N); break;
    case 7: run<7>(xp, wp, b, yp, K, N); break;
    default: run<8>(xp, wp, b, yp, K, N); break;
  }
  return y;
}
