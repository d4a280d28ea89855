// Element-wise steps of a decoder layer fused into single passes over memory (float32 and bfloat16).
// Each replaces several torch ops (and their temporaries); per decode step a 30-layer model runs ~10 of
// these per layer, so at small batches the launch and allocation cost matters as much as the arithmetic.
//
// bfloat16 (the norm and rotary): arithmetic in float32, rounded to bf16 (nearest even) exactly where the torch
// ops of the reference (layers/layernorm.py, rotary_embedding.py) round each op's result, so the fused pass gives
// their values bit for bit (the norm's sum of squares may differ in its last float bit).
#include "bf16_rows.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include "simd/exp2_poly.h"
#endif

namespace {

// Loads widen to float; stores (and `round`) round to the element type. float: identities.
template <typename T>
struct Elem {
  static float load(const T* p) { return *p; }
  static void store(T* p, float v) { *p = v; }
  static float round(float v) { return v; }
};

template <>
struct Elem<c10::BFloat16> {  // plain integer ops on the bits, so the loops vectorize
  static float load(const c10::BFloat16* p) { return __builtin_bit_cast(float, static_cast<uint32_t>(p->x) << 16); }
  static uint32_t rounded_bits(float v) {  // nearest even; NaN stays NaN (an integer test: -ffast-math)
    const uint32_t u = __builtin_bit_cast(uint32_t, v);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (u | 0x00400000u) : u + 0x7FFFu + ((u >> 16) & 1u);
  }
  static void store(c10::BFloat16* p, float v) { p->x = static_cast<uint16_t>(rounded_bits(v) >> 16); }
  static float round(float v) { return __builtin_bit_cast(float, rounded_bits(v) & 0xFFFF0000u); }
};

// sum over c < n of f(c) in 32 float lanes (four AVX2 or two AVX-512 accumulators): an `omp simd` reduction keeps
// one vector accumulator, whose add latency then bounds a row's sum.
template <typename F>
inline float lane_sum(int64_t n, F&& f) {
  float acc[32] = {};
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
#pragma omp simd
    for (int l = 0; l < 32; ++l) acc[l] += f(c + l);
  }
  float total = 0.f;
  for (; c < n; ++c) total += f(c);
  for (int l = 0; l < 32; ++l) total += acc[l];
  return total;
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16,
              name, " must be float32 or bfloat16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [T, C] with contiguous rows");
}

void check_same_dtype(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have the dtype of x (", like.scalar_type(), ")");
}

// Whether a residual is given; if one is, that it is [T, C] rows in x's dtype.
bool check_residual(const std::optional<torch::Tensor>& residual, const torch::Tensor& x) {
  if (!residual.has_value() || !residual->defined()) return false;
  check_rows(*residual, "residual");
  check_same_dtype(*residual, x, "residual");
  TORCH_CHECK(residual->size(0) == x.size(0) && residual->size(1) == x.size(1), "residual must match x");
  return true;
}

// LayerNorm's weight and bias: contiguous [C] in x's dtype.
void check_weight_bias(const torch::Tensor& weight, const torch::Tensor& bias, const torch::Tensor& x) {
  check_same_dtype(weight, x, "weight");
  check_same_dtype(bias, x, "bias");
  const int64_t C = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == C && bias.is_contiguous() && bias.numel() == C,
              "weight and bias must be contiguous [C]");
}

// out, checked to be [T, C] rows like x, or a new tensor when none is given.
torch::Tensor out_like(const torch::Tensor& x, const std::optional<torch::Tensor>& out) {
  torch::Tensor y = out.has_value() ? *out : torch::empty({x.size(0), x.size(1)}, x.options());
  check_rows(y, "out");
  check_same_dtype(y, x, "out");
  TORCH_CHECK(y.size(0) == x.size(0) && y.size(1) == x.size(1), "out must be [T, C] like x");
  return y;
}

// f(E{}) with E the element type of x: float or c10::BFloat16 (check_rows refuses the rest).
template <typename F>
void with_element_type(const torch::Tensor& x, F&& f) {
  if (x.scalar_type() == torch::kFloat32) {
    f(float{});
  } else {
    f(c10::BFloat16{});
  }
}

// t's elements, or nullptr for an absent residual.
template <typename E>
E* maybe_data(const std::optional<torch::Tensor>& t, bool present) {
  return present ? t->data_ptr<E>() : nullptr;
}

// Row t of dst = rms_norm(src row t) * w. With res, first res = src + res and dst = res (then src must be dst:
// the in-place form); without, src is only read (dst may be another tensor).
template <typename T>
void rms_norm_rows(const T* src, int64_t src_stride, T* dst, int64_t dst_stride, T* res, int64_t res_stride,
                   const T* w, int64_t rows, int64_t C, float eps) {
  using E = Elem<T>;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* in = src + t * src_stride;
      T* row = dst + t * dst_stride;
      float ss = 0.f;
      if (res) {
        T* r = res + t * res_stride;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < C; ++c) {
          const float v = E::round(E::load(in + c) + E::load(r + c));
          E::store(r + c, v);
          E::store(row + c, v);
          ss += v * v;
        }
        in = row;
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < C; ++c) {
          const float v = E::load(in + c);
          ss += v * v;
        }
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) E::store(row + c, E::load(w + c) * E::round(E::load(in + c) * inv));
    }
  });
}

// Row t of dst = layer_norm(src row t) * w + b, as torch's LayerNorm: mean and variance in float32, then
// (x * rstd - mean * rstd) * w + b in float32, rounded once. With res, first res = src + res and dst = res (the
// in-place form: src is dst); without, src is only read.
template <typename T>
void layer_norm_rows(const T* src, int64_t src_stride, T* dst, int64_t dst_stride, T* res, int64_t res_stride,
                     const T* w, const T* b, int64_t rows, int64_t C, float eps) {
  using E = Elem<T>;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* in = src + t * src_stride;
      T* row = dst + t * dst_stride;
      if (res) {
        T* r = res + t * res_stride;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const float v = E::round(E::load(in + c) + E::load(r + c));
          E::store(r + c, v);
          E::store(row + c, v);
        }
        in = row;
      }
      const float mean = lane_sum(C, [&](int64_t c) { return E::load(in + c); }) / static_cast<float>(C);
      const float var = lane_sum(C, [&](int64_t c) {
        const float d = E::load(in + c) - mean;
        return d * d;
      }) / static_cast<float>(C);
      const float rstd = 1.f / std::sqrt(var + eps), shift = -mean * rstd;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c)
        E::store(row + c, (E::load(in + c) * rstd + shift) * E::load(w + c) + E::load(b + c));
    }
  });
}

template <typename T>
void rotary_rows(T* base, int64_t stride, const int64_t* pos, const T* cs, int64_t rows, int64_t num_heads,
                 int64_t head_dim) {
  using E = Elem<T>;
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cs + pos[t] * head_dim;
      const T* s = c + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x1 = base + t * stride + h * head_dim;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = E::load(x1 + i), b = E::load(x2 + i), ci = E::load(c + i), si = E::load(s + i);
          E::store(x1 + i, E::round(a * ci) - E::round(b * si));
          E::store(x2 + i, E::round(b * ci) + E::round(a * si));
        }
      }
    }
  });
}

// e[i] = exp(-x[i]) for a row of n elements. With AVX-512 by exp2_poly (relative error < 3e-6; with libmvec's 16-lane
// expf the whole SiLU-and-multiply pass took 1.5x as long), elsewhere by expf. e is kept finite (2^t for t <= 126,
// expf of at most 87), since x / (1 + e) built with -ffast-math (a reciprocal and a Newton step) turns an infinite
// divisor into NaN: silu(-100) must come out ~0, as torch's.
template <typename T>
inline void exp_negated(const T* x, int64_t n, float* e) {
  using E = Elem<T>;
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  const __m512 minus_log2e = _mm512_set1_ps(-LOG2E), lo = _mm512_set1_ps(-150.f), hi = _mm512_set1_ps(126.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 t = _mm512_mul_ps(load16(x + i), minus_log2e);
    _mm512_storeu_ps(e + i, exp2_poly(_mm512_min_ps(_mm512_max_ps(t, lo), hi)));
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) e[j] = expf(std::min(-E::load(x + j), 87.f));
}

// silu(gate) * up, row by row. In bf16 the silu is rounded to bf16 before the product, as torch's two ops round
// it, so the fused pass gives their values (but where the exp itself rounds the other way); float32 rounds nothing.
template <typename T>
void silu_and_mul_rows(const T* in, int64_t stride, T* op, int64_t rows, int64_t I) {
  using E = Elem<T>;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> e;  // exp(-gate) of one row; kept across calls (no allocation per step)
    e.resize(static_cast<size_t>(I));
    for (int64_t t = begin; t < end; ++t) {
      const T* g = in + t * stride;
      const T* u = g + I;
      T* o = op + t * I;
      exp_negated(g, I, e.data());
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) E::store(o + i, E::round(E::load(g + i) / (1.f + e[i])) * E::load(u + i));
    }
  });
}

}  // namespace

// x [T, C], residual [T, C] or none, weight [C]. In place: with a residual, residual = x + residual and
// x = rms_norm(residual) * weight; without, x = rms_norm(x) * weight.
void rms_norm_(torch::Tensor& x, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
               double eps) {
  check_rows(x, "x");
  check_same_dtype(weight, x, "weight");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  TORCH_CHECK(weight.numel() == x.size(1), "weight must have ", x.size(1), " elements");
  const bool has_res = check_residual(residual, x);
  with_element_type(x, [&](auto e) {
    using E = decltype(e);
    E* xp = x.data_ptr<E>();
    rms_norm_rows<E>(xp, x.stride(0), xp, x.stride(0), maybe_data<E>(residual, has_res),
                     has_res ? residual->stride(0) : 0, weight.data_ptr<E>(), x.size(0), x.size(1),
                     static_cast<float>(eps));
  });
}

// x [T, C], residual [T, C] or none, weight and bias [C]. In place: with a residual, residual = x + residual and
// x = layer_norm(residual) * weight + bias; without, x = layer_norm(x) * weight + bias.
void layer_norm_(torch::Tensor& x, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                 const torch::Tensor& bias, double eps) {
  check_rows(x, "x");
  check_weight_bias(weight, bias, x);
  const bool has_res = check_residual(residual, x);
  with_element_type(x, [&](auto e) {
    using E = decltype(e);
    E* xp = x.data_ptr<E>();
    layer_norm_rows<E>(xp, x.stride(0), xp, x.stride(0), maybe_data<E>(residual, has_res),
                       has_res ? residual->stride(0) : 0, weight.data_ptr<E>(), bias.data_ptr<E>(), x.size(0),
                       x.size(1), static_cast<float>(eps));
  });
}

// x [T, C] -> layer_norm(x) * weight + bias [T, C] in out (allocated when none), x left as it is.
torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                         const std::optional<torch::Tensor>& out) {
  check_rows(x, "x");
  check_weight_bias(weight, bias, x);
  torch::Tensor y = out_like(x, out);
  with_element_type(x, [&](auto e) {
    using E = decltype(e);
    layer_norm_rows<E>(x.data_ptr<E>(), x.stride(0), y.data_ptr<E>(), y.stride(0), nullptr, 0,
                       weight.data_ptr<E>(), bias.data_ptr<E>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return y;
}

// In place: each of num_heads heads of D = weight.numel() values, from column col of every row of x (rows may be
// strided: the fused qkv output), -> rms_norm(head) * weight (Qwen3's per-head q/k norms, without a copy out and
// back). The heads of one row are D apart and the rows stride(0) apart, so one call of rms_norm_rows per head.
void rms_norm_heads_(torch::Tensor& x, const torch::Tensor& weight, int64_t col, int64_t num_heads, double eps) {
  check_rows(x, "x");
  check_same_dtype(weight, x, "weight");
  const int64_t D = weight.numel();
  TORCH_CHECK(weight.is_contiguous() && D > 0, "weight must be [D], contiguous");
  TORCH_CHECK(col >= 0 && num_heads >= 0 && col + num_heads * D <= x.size(1), "the heads run past x's columns");
  with_element_type(x, [&](auto e) {
    using E = decltype(e);
    E* base = x.data_ptr<E>() + col;
    for (int64_t h = 0; h < num_heads; ++h)
      rms_norm_rows<E>(base + h * D, x.stride(0), base + h * D, x.stride(0), nullptr, 0, weight.data_ptr<E>(),
                       x.size(0), D, static_cast<float>(eps));
  });
}

namespace {

// GCC / Clang vector of 16 floats: one zmm on AVX-512, two ymm on AVX2, whatever the build targets.
typedef float f32x16 __attribute__((vector_size(64)));

// The rows of the order-16 Sylvester Hadamard matrix, H16[i][j] = (-1)^popcount(i & j) (symmetric).
struct Hadamard16 {
  f32x16 row[16];
  Hadamard16() {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) row[i][j] = (__builtin_popcount(i & j) & 1) ? -1.0f : 1.0f;
  }
};
const Hadamard16 kHadamard16;

// v[0:16 C] <- each 16-value chunk @ H16, as 16 broadcast multiply-adds per chunk; C chunks at once keep C
// independent chains in flight (one chain alone waits on its own latency).
template <int C>
void hadamard16_chunks(float* v) {
  f32x16 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = kHadamard16.row[0] * v[c * 16];
  for (int j = 1; j < 16; ++j)
    for (int c = 0; c < C; ++c) acc[c] += kHadamard16.row[j] * v[c * 16 + j];
  for (int c = 0; c < C; ++c) std::memcpy(v + c * 16, &acc[c], sizeof(f32x16));
}

// v[0:n] <- v @ blockdiag(H_block): a fast Walsh-Hadamard transform. Its four stages inside each 16 values run as
// one 16 x 16 sign product (hadamard16_chunks) and the stages across 16-value chunks as whole-vector adds (the
// stages commute: H_block is a Kronecker product of 2 x 2 factors); blocks under 16 (head sizes like 72) take the
// plain butterflies.
void hadamard_blocks(float* v, int64_t n, int64_t block) {
  if (block < 16) {
    for (int64_t b0 = 0; b0 < n; b0 += block)
      for (int64_t len = 1; len < block; len *= 2)
        for (int64_t j0 = b0; j0 < b0 + block; j0 += 2 * len)
          for (int64_t j = j0; j < j0 + len; ++j) {
            const float a = v[j], c = v[j + len];
            v[j] = a + c;
            v[j + len] = a - c;
          }
    return;
  }
  int64_t c0 = 0;
  for (; c0 + 64 <= n; c0 += 64) hadamard16_chunks<4>(v + c0);
  for (; c0 < n; c0 += 16) hadamard16_chunks<1>(v + c0);
  for (int64_t b0 = 0; b0 < n; b0 += block)
    for (int64_t len = 16; len < block; len *= 2)
      for (int64_t j0 = b0; j0 < b0 + block; j0 += 2 * len) {
        float* a = v + j0;
        float* c = v + j0 + len;
        for (int64_t j = 0; j < len; ++j) {
          const float x = a[j], y = c[j];
          a[j] = x + y;
          c[j] = x - y;
        }
      }
}

}  // namespace

// In place: each head h of every row t of x [T, H, D] (strided rows and heads, contiguous within a head) ->
// head @ (blockdiag(H_block) * scale), H_block the Sylvester Hadamard matrix of order block (a power of two dividing
// D): an fp8 cache's key rotation (attention/key_rotation.py), in float32, rounded to x's dtype once.
void hadamard_heads_(torch::Tensor& x, int64_t block, double scale) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, H, D] with contiguous heads");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(block > 0 && (block & (block - 1)) == 0 && D % block == 0 && D <= 1024,
              "block must be a power of two dividing D (D <= 1024)");
  const float s = static_cast<float>(scale);
  with_element_type(x, [&](auto e) {
    using E = decltype(e);
    E* base = x.data_ptr<E>();
    const int64_t st = x.stride(0), sh = x.stride(1);
    at::parallel_for(0, T * H, 256, [&](int64_t begin, int64_t end) {
      alignas(64) float v[1024];
      for (int64_t i = begin; i < end; ++i) {
        E* head = base + (i / H) * st + (i % H) * sh;
        for (int64_t d = 0; d < D; ++d) v[d] = static_cast<float>(head[d]);
        hadamard_blocks(v, D, block);
        for (int64_t d = 0; d < D; ++d) head[d] = static_cast<E>(v[d] * s);
      }
    });
  });
}

// x [T, C] -> rms_norm(x) * weight [T, C] in out (allocated when none), x left as it is.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       const std::optional<torch::Tensor>& out) {
  check_rows(x, "x");
  check_same_dtype(weight, x, "weight");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [C], contiguous");
  torch::Tensor y = out_like(x, out);
  with_element_type(x, [&](auto e) {
    using E = decltype(e);
    rms_norm_rows<E>(x.data_ptr<E>(), x.stride(0), y.data_ptr<E>(), y.stride(0), nullptr, 0,
                     weight.data_ptr<E>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return y;
}

// qk [T, >= num_heads * D] (rows may be strided: the fused qkv output), positions [T] int64,
// cos_sin [P, D] = [cos | sin] per position. Rotates the first num_heads heads of every row in place,
// rotate-half pairing (element i with i + D/2).
void rotary_(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos_sin, int64_t num_heads,
             int64_t head_dim) {
  check_rows(qk, "qk");
  check_same_dtype(cos_sin, qk, "cos_sin");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.size(1) == head_dim, "cos_sin must be [P, head_dim]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == qk.size(0), "positions [T] int64");
  TORCH_CHECK(qk.size(1) >= num_heads * head_dim && head_dim % 2 == 0, "qk too narrow for num_heads");
  const int64_t T = qk.size(0), stride = qk.stride(0), P = cos_sin.size(0);
  const torch::Tensor pos_c = positions.contiguous();
  const int64_t* pos = pos_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position out of range");
  if (qk.scalar_type() == torch::kFloat32) {
    rotary_rows(qk.data_ptr<float>(), stride, pos, cos_sin.data_ptr<float>(), T, num_heads, head_dim);
  } else {
    rotary_rows(qk.data_ptr<c10::BFloat16>(), stride, pos, cos_sin.data_ptr<c10::BFloat16>(), T, num_heads,
                head_dim);
  }
}

// gate_up [T, 2I] = [gate | up] -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(const torch::Tensor& gate_up, const std::optional<torch::Tensor>& out) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up width must be even");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  torch::Tensor y = out.has_value() ? *out : torch::empty({T, I}, gate_up.options());
  TORCH_CHECK(y.scalar_type() == gate_up.scalar_type() && y.is_contiguous() && y.dim() == 2 && y.size(0) == T &&
              y.size(1) == I, "out must be a contiguous [T, I] of gate_up's dtype");
  with_element_type(gate_up, [&](auto e) {
    using E = decltype(e);
    silu_and_mul_rows<E>(gate_up.data_ptr<E>(), stride, y.data_ptr<E>(), T, I);
  });
  return y;
}

// table [V, C] (contiguous rows), ids [T] int64 -> table[ids] [T, C] in out (allocated when none).
torch::Tensor embedding_rows(const torch::Tensor& table, const torch::Tensor& ids,
                             const std::optional<torch::Tensor>& out) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous(), "table must be a contiguous [V, C]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "ids must be [T] int64");
  const int64_t T = ids.size(0), V = table.size(0), C = table.size(1);
  torch::Tensor y = out.has_value() ? *out : torch::empty({T, C}, table.options());
  TORCH_CHECK(y.scalar_type() == table.scalar_type() && y.is_contiguous() && y.dim() == 2 && y.size(0) == T &&
              y.size(1) == C, "out must be a contiguous [T, C] of the table's dtype");
  const torch::Tensor ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < V, "token id ", id[t], " out of range [0, ", V, ")");
  const int64_t row_bytes = C * static_cast<int64_t>(table.element_size());
  const char* src = static_cast<const char*>(table.data_ptr());
  char* dst = static_cast<char*>(y.data_ptr());
  for (int64_t t = 0; t < T; ++t) std::memcpy(dst + t * row_bytes, src + id[t] * row_bytes, row_bytes);
  return y;
}
