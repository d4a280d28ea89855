// The quantized tiles in portable C++ (the vector layer's one-lane Scalar): CPUs without AVX2, and the tests'
// reference paths (isa 3). See isa_kernels.h.
#include "dot_gemm.h"
#include "isa_kernels.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

namespace {
using namespace isa;
#include "simd/vec_scalar.h"
#include "simd/widen_tiles.h"
#include "simd/dot_tiles.h"
#include "simd/word_tiles.h"
}  // namespace

namespace isa {
extern constexpr WidenKernels kScalarWiden = widen_kernels<Scalar, false>();
extern constexpr DotKernels kScalarDot = dot_kernels<Scalar, true, false>();
extern constexpr WordKernels kScalarWords = word_kernels<Scalar, 4, 1>();
}  // namespace isa
