// kernels_for(): the one place that turns a kernel's `isa` argument into a set of tiles (see isa_kernels.h).
#include "isa_kernels.h"

#include "cpu_features.h"

namespace isa {
namespace {
const Kernels kGeneric{"generic", &kScalarWiden, &kScalarDot, &kScalarWords};
#if defined(__x86_64__)
const Kernels kAvx2{"avx2", &kAvx2Widen, &kAvx2Dot, &kAvx2Words};
const Kernels kAvx512Vnni{"avx512-vnni", &kAvx512Widen, &kVnni512Dot, &kVnni512Words};
// no VNNI: AVX2's byte products, and int16 pair products by vpmaddwd
const Kernels kAvx512{"avx512", &kAvx512Widen, &kAvx2Dot, &kAvx512Words};
#endif
}  // namespace

const Kernels& kernels_for(int64_t request) {
  const int resolved = resolve_isa(request);
#if defined(__x86_64__)
  if (resolved == ISA_AVX512) return cpu_has_vnni512() ? kAvx512Vnni : kAvx512;
  if (resolved == ISA_AVX2) return kAvx2;
#endif
  return kGeneric;
}

bool has_byte_dot() { return kernels_for(ISA_AUTO).dot->q8_half[0] != nullptr; }

}  // namespace isa
