// The quantized tiles for AVX2 + FMA + F16C (8 float lanes). See isa_kernels.h: everything between the target
// pragmas is built for AVX2 whatever the build's -march, and is run only after kernels_for() checked the CPU.
#include "dot_gemm.h"
#include "isa_kernels.h"

#include <cstdint>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
using namespace isa;
#include "simd/vec_avx2.h"
#include "simd/widen_tiles.h"
#include "simd/dot_tiles.h"
#include "simd/word_tiles.h"
}  // namespace
#pragma GCC pop_options

namespace isa {
extern constexpr WidenKernels kAvx2Widen = widen_kernels<Avx2, false>();
extern constexpr DotKernels kAvx2Dot = dot_kernels<Avx2, false, false>();
extern constexpr WordKernels kAvx2Words = word_kernels<Avx2, 4, 1>();
}  // namespace isa
#endif
