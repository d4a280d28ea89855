// The byte-dot-product tiles for AVX-512 with VNNI (vpdpbusd: 64 u8 x s8 multiply-adds an instruction). See
// isa_kernels.h; kernels_for() takes these only on a CPU with avx512_vnni. Its words tiles multiply int16 pairs by
// vpdpwssd.
#include "dot_gemm.h"
#include "isa_kernels.h"

#include <cstdint>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace {
using namespace isa;
#include "simd/vec_avx512.h"
Avx512::I Avx512::dot_u8s8(I acc, B u, B s) { return _mm512_dpbusd_epi32(acc, u, s); }
Avx512::I Avx512::dot_s16(I acc, B a, B b) { return _mm512_dpwssd_epi32(acc, a, b); }
#include "simd/dot_tiles.h"
#include "simd/word_tiles.h"
}  // namespace
#pragma GCC pop_options

namespace isa {
extern constexpr DotKernels kVnni512Dot = dot_kernels<Avx512, true, true>();
extern constexpr WordKernels kVnni512Words = word_kernels<Avx512, 6, 2>();
}  // namespace isa
#endif
