// Run-time CPU feature checks and the `isa` argument of the quantized matmul kernels (resolved into a set of
// tiles by isa::kernels_for, isa_kernels.cpp): 0 = best available, 1 = AVX2+FMA(+F16C), 2 = AVX-512F/BW/VL,
// 3 = portable C++. One build serves every CPU kind; tests force every path.
#pragma once
#include <torch/extension.h>

constexpr int ISA_AUTO = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_GENERIC = 3;
// The byte-dot-product matmuls (q4_dot_gemm, q8_dot_gemm) also take 4: AMX tiles (amx_dot.h), never chosen by auto
// (the autotuner times it per row count: it wins for many rows only).
constexpr int ISA_AMX = 4;
// ... and a flag on 0..3: their "words" tiles (words_gemm.h: int16 pair products, for many rows; the autotuner
// times them per row count).
constexpr int ISA_WORDS = 8;

inline bool cpu_has_avx2() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

inline bool cpu_has_avx512() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

inline bool cpu_has_vnni512() {
#if defined(__x86_64__)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// The ISA a call runs: `isa` resolved (auto -> the best this CPU has), or an error naming what is missing.
inline int resolve_isa(int64_t isa) {
  if (isa == ISA_AUTO) return cpu_has_avx512() ? ISA_AVX512 : cpu_has_avx2() ? ISA_AVX2 : ISA_GENERIC;
  TORCH_CHECK(isa == ISA_AVX2 || isa == ISA_AVX512 || isa == ISA_GENERIC, "isa must be 0..3, got ", isa);
  TORCH_CHECK(isa != ISA_AVX2 || cpu_has_avx2(), "this CPU has no AVX2+FMA+F16C");
  TORCH_CHECK(isa != ISA_AVX512 || cpu_has_avx512(), "this CPU has no AVX-512F/BW/VL");
  return static_cast<int>(isa);
}
