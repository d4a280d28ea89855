// What every AMX kernel needs: the tile state granted by the kernel (once a process) and the tile configuration
// block `ldtilecfg` reads. Each kernel configures the tiles it uses on each thread and releases them at the end.
#pragma once
#include <cstdint>

#if defined(__x86_64__) && defined(__linux__)
#define PAGEDLLM_AMX 1
#endif

namespace amx_tiles {

// Whether this CPU has AMX-TILE plus the extension named (AMX-INT8: the byte dot products, AMX-BF16: bf16 pairs),
// AVX-512 for the vector work around them, and the kernel granted this process the tile state (asked once).
bool int8_supported();
bool bf16_supported();

// Hands the tile state back (tilerelease) at the end of a thread's AMX work; a no-op without AMX.
void release();

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace amx_tiles

#if defined(PAGEDLLM_AMX)
// Not _tile_loadconfig: GCC 12's tells the compiler it reads 8 bytes, so the rest of the block may be unwritten.
#define PAGEDLLM_LOAD_TILE_CONFIG(cfg) asm volatile("ldtilecfg %0" ::"m"(cfg))
#endif
