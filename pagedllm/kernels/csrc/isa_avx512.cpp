// The weight-only quantized tiles for AVX-512F/BW/VL (16 float lanes). See isa_kernels.h. The byte-dot tiles,
// which need VNNI as well, are built apart in isa_vnni512.cpp so that nothing here can use a VNNI instruction; the
// words tiles here multiply int16 pairs by vpmaddwd.
#include "dot_gemm.h"
#include "isa_kernels.h"

#include <cstdint>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace {
using namespace isa;
#include "simd/vec_avx512.h"
#include "simd/widen_tiles.h"
Avx512::I Avx512::dot_s16(I acc, B a, B b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#include "simd/word_tiles.h"
}  // namespace
#pragma GCC pop_options

namespace isa {
extern constexpr WidenKernels kAvx512Widen = widen_kernels<Avx512, true>();
extern constexpr WordKernels kAvx512Words = word_kernels<Avx512, 6, 2>();
}  // namespace isa
#endif
