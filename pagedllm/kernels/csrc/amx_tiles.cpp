// The AMX tile state: asked of the kernel once a process (amx_tiles.h).
#include "amx_tiles.h"

#include "cpu_features.h"

#if defined(PAGEDLLM_AMX)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace amx_tiles {
namespace {

constexpr unsigned AMX_BF16 = 1u << 22, AMX_TILE = 1u << 24, AMX_INT8 = 1u << 25;  // CPUID.(7,0):EDX

unsigned amx_bits() {
#if defined(PAGEDLLM_AMX)
  static const unsigned bits = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0u;
    return d & (AMX_BF16 | AMX_TILE | AMX_INT8);
  }();
  return bits;
#else
  return 0;
#endif
}

// Linux hands out the tile state (8 KiB of registers per thread) only to processes that ask.
bool tile_state_granted() {
#if defined(PAGEDLLM_AMX)
  static const bool granted = [] {
    if (!(amx_bits() & AMX_TILE) || !cpu_has_avx512()) return false;
    constexpr int ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) != 0) return false;
    return (bits & (1ul << XFEATURE_XTILEDATA)) != 0;
  }();
  return granted;
#else
  return false;
#endif
}

}  // namespace

#if defined(PAGEDLLM_AMX)
__attribute__((target("amx-tile"))) void release() { _tile_release(); }
#else
void release() {}
#endif

bool int8_supported() { return (amx_bits() & AMX_INT8) && tile_state_granted(); }
bool bf16_supported() { return (amx_bits() & AMX_BF16) && tile_state_granted(); }

}  // namespace amx_tiles
