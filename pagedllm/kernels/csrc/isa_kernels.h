// The quantized matmuls' tiles, written once against a small vector layer (simd/vec_*.h) and compiled once per
// instruction set, and the one run-time choice among them.
//
// Each ISA's tiles live in their own translation unit (isa_generic.cpp, isa_avx2.cpp, isa_avx512.cpp,
// isa_vnni512.cpp): the templates of simd/widen_tiles.h and simd/dot_tiles.h included inside a
// `#pragma GCC target(...)` region and an anonymous namespace, so every instantiation is built for that ISA and
// none can be merged with another ISA's copy by the linker. One build runs on every x86 CPU kind; the callers
// (quant_gemm.cpp, q4_dot_gemm.cpp, q8_dot_gemm.cpp, w8a8_gemm.cpp) hold no intrinsics and choose a set of tiles
// through kernels_for() only, which resolves the `isa` argument against the CPU (tests force every path).
#pragma once
#include <cstdint>

namespace isa {

constexpr int64_t NR = 16;          // output columns per weight panel
constexpr int kMaxWidenRows = 8;    // rows of the widest widening tile
constexpr int kDotRows = 4;         // rows of a byte-dot tile
constexpr int kW8a8Rows = 8;
constexpr int kMaxWordRows = 8;     // rows of the widest words tile
constexpr int kMaxWordPanels = 2;   // panels of 16 columns a words tile spans at most

// Weights widened to float in registers (quant_gemm.cpp). The tiles compute rows x 16 columns of panel p into
// tmp [rows][16] (scaled, without bias).
struct WidenProblem {
  const float* x;      // [M, ldx]
  int64_t ldx;
  const uint8_t* w;    // panel p at w + p * panel_bytes
  int64_t panel_bytes;
  const float* scales;  // [P, G, 16]
  const float* mins;    // [P, G, 16] (4-bit only)
  const float* xsum;    // [M, G] (4-bit only)
  int64_t K, G, group;
};
using WidenTile = void (*)(const WidenProblem&, int64_t p, int64_t m0, float* tmp);
using DequantPanel = void (*)(const WidenProblem&, int64_t p, float* dst);  // panel p -> float [K, 16]
using F32Tile = void (*)(const float* x, int64_t ldx, const float* w, int64_t K, float* tmp);

enum Format { kQ8 = 0, kQ4 = 1, kF8 = 2 };

struct WidenKernels {
  int rows;                                // rows of the largest tile (a register budget)
  WidenTile tiles[3][kMaxWidenRows];       // [format][rows - 1]
  DequantPanel dequant[3];                 // [format]
  F32Tile f32[kMaxWidenRows];              // nullptr: many rows use packed_gemm.cpp's kernel on packed x
};

// x split per (row, group) into two int8 terms (dot_gemm.h) times byte panels (q4_dot_gemm.cpp: 4-bit "dot8",
// q8_dot_gemm.cpp: 8-bit "dot4" offset by 128). The tiles compute rows x 16 columns of panel p into acc.
struct DotProblem {
  const uint8_t* w;     // panel p at w + p * panel_bytes
  int64_t panel_bytes;
  const void* scales;   // [P, G, 16] float16 bits (or float for q8 when !half_scales)
  bool half_scales;
  const uint16_t* mins;  // [P, G, 16] float16 bits (4-bit only)
  const int8_t* x1;      // [M, K]
  const int8_t* x2;      // [M, K]
  const float* d;        // [M, G] the step of x1
  const float* s;        // [M, G] sum of x
  const int32_t* s1;     // [M, G] sum of x1
  const int32_t* s2;     // [M, G] sum of x2
  int64_t K, G, group;
};
using DotTile = void (*)(const DotProblem&, int64_t p, int64_t m0, float* acc);

// One group of one row: x1, x2 written, (dx, sum x, sum x1, sum x2) returned.
struct GroupStats {
  float d, sum;
  int32_t s1, s2;
};
using SplitGroup = GroupStats (*)(const float* r, int64_t group, int8_t* q1, int8_t* q2);

// W8A8 (w8a8_gemm.cpp): x quantized per row to u8 (+128), weights regrouped into k-quads per call.
using W8a8Tile = void (*)(const uint8_t* xq, int64_t Kp, const int8_t* quads, const int32_t* colsum,
                          const float* sx, const float* sw, float* tmp);

struct DotKernels {
  SplitGroup split_group;
  DotTile q4[kDotRows], q4_short[kDotRows];         // 4-bit; _short for groups of at most 32 k
  DotTile q8_half[kDotRows], q8_float[kDotRows];    // 8-bit, float16 / float32 scales; nullptr without VNNI
  W8a8Tile w8a8[kW8a8Rows];                          // nullptr without VNNI
};

// The "words" tiles (words_gemm.cpp): dot8 / dot4 panels widened once per block of rows into int16 pairs, times
// x as one int16 term x16 = 254 x1 + x2 (the two int8 terms above, combined exactly), by int16 pair products
// (AVX-512 VNNI's vpdpwssd, vpmaddwd elsewhere): for many rows, where the byte tiles' two products per 4 k and
// their per-group float work bound the loop.
struct WordsProblem {
  const int16_t* x16;     // [M, K]
  const float* dx;        // [M, G] x16's step: dx / 254
  const float* s;         // [M, G] sum of x (4-bit weights' mins)
  const int32_t* offsets;  // [M, G] 128 * sum of x16 (8-bit weights, stored + 128), else nullptr
  int64_t K, G, group;
};
// The panels one tile spans, widened: q int32 pairs [NP][K/2][16]; scales and mins float [NP][G][16] (mins
// nullptr for 8-bit weights).
struct WidenedPanels {
  const int32_t* q;
  const float* scales;
  const float* mins;
};
using WordsTile = void (*)(const WordsProblem&, const WidenedPanels&, int64_t m0, float* acc);
using WidenPanel = void (*)(const uint8_t* panel, int64_t K, int32_t* dst);  // one panel -> int16 pairs [K/2][16]
using WidenHalves = void (*)(const uint16_t* src, int64_t n, float* dst);     // float16 bits -> float (n % 16 == 0)
// acc [rows][width] (+ bias[0, cols)) -> y [rows][0, cols) (rows ldy apart), streamed past the caches or not
using StoreRows = void (*)(const float* acc, int rows, int64_t width, int64_t cols, const float* bias, float* y,
                           int64_t ldy, bool stream);

struct WordKernels {
  int rows, panels;                                   // the largest tile: rows x (panels x 16) columns
  // [panels - 1][rows - 1]: 4-bit weights (with mins) and 8-bit ones (+ 128: without)
  WordsTile q4[kMaxWordPanels][kMaxWordRows], q8[kMaxWordPanels][kMaxWordRows];
  WidenPanel widen_dot8, widen_dot4;
  WidenHalves widen_halves;
  StoreRows store_rows;
};

// A resolved instruction set: its name and its tiles.
struct Kernels {
  const char* name;
  const WidenKernels* widen;
  const DotKernels* dot;
  const WordKernels* words;
};

// The tiles for `isa` (cpu_features.h: 0 = best on this CPU, 1 = AVX2, 2 = AVX-512, 3 = portable); an error
// naming what the CPU lacks when it cannot run them. AVX-512 without VNNI takes AVX2's byte-dot tiles.
const Kernels& kernels_for(int64_t isa);
// Whether kernels_for(0) has an exact 8-bit byte dot product (AVX-512 VNNI).
bool has_byte_dot();

// Defined by the ISA translation units.
extern const WidenKernels kScalarWiden, kAvx2Widen, kAvx512Widen;
extern const DotKernels kScalarDot, kAvx2Dot, kVnni512Dot;
extern const WordKernels kScalarWords, kAvx2Words, kAvx512Words, kVnni512Words;

}  // namespace isa
