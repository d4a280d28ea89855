// Bidirectional bf16 attention on AMX tiles: the two matmuls of encoder_attention_bf16.h's passes as tile dot
// products (tdpbf16ps), 16 x 16 x 32 multiply-adds an instruction. Intel Xeon (Sapphire Rapids on): 4.6-5.2 ms a
// layer of Whisper base's encoder against 7.3-8.2 for torch's flash kernel (docs/performance.md).
#include "amx_tiles.h"
#include "encoder_attention_bf16.h"
#include "kernels.h"

bool encoder_attention_amx_takes(const torch::Tensor& query) {
  // The vector passes around the tiles use AVX-512 DQ (vreduceps) and BF16 (the conversions): every AMX CPU so far
  // has both, but the check costs nothing.
#if defined(__x86_64__)
  static const bool vectors = __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
#else
  static const bool vectors = false;
#endif
  return query.scalar_type() == torch::kBFloat16 && (query.size(2) == 32 || query.size(2) == 64) && vectors &&
         amx_tiles::bf16_supported();
}

#if defined(PAGEDLLM_AMX)
namespace {

using encoder_bf16::KC;
using encoder_bf16::KT;
using encoder_bf16::Task;

struct TilePasses {
  static void begin() {
    amx_tiles::TileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    PAGEDLLM_LOAD_TILE_CONFIG(cfg);
  }
  static void end() { amx_tiles::release(); }

  // Pass 1: S [2 halves][Lp / 16 key tiles][16 rows][16 keys] = Q K^T. Tiles: C 0-1 (query halves), B 2-3 (key
  // dims 0-31, 32-63), A 4-7 (Q half x dims). A C tile waits on its two dot products before it is stored: with eight
  // tiles there is no room for a second pair in flight, which keeps this pass at about half the tiles' peak.
  template <int CH>
  __attribute__((target("amx-tile,amx-bf16"))) static void scores(const Task& t, float* s) {
    _tile_loadd(4, t.q, t.q_stride);
    _tile_loadd(6, reinterpret_cast<const char*>(t.q) + 16 * t.q_stride, t.q_stride);
    if constexpr (CH == 2) {
      _tile_loadd(5, t.q + 32, t.q_stride);
      _tile_loadd(7, reinterpret_cast<const char*>(t.q + 32) + 16 * t.q_stride, t.q_stride);
    }
    const int64_t key_tiles = t.Lp / KT;
    for (int64_t kt = 0; kt < key_tiles; ++kt) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(2, t.kp + kt * 256, 64);
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 6, 2);
      if constexpr (CH == 2) {
        _tile_loadd(3, t.kp + (key_tiles + kt) * 256, 64);
        _tile_dpbf16ps(0, 5, 3);
        _tile_dpbf16ps(1, 7, 3);
      }
      _tile_stored(0, s + kt * 256, 64);
      _tile_stored(1, s + (key_tiles + kt) * 256, 64);
    }
    asm volatile("" ::: "memory");  // GCC's _tile_stored declares no memory write
  }

  // Pass 3: O [QB, D] = P V. Tiles: C 0-3 (query half x two dim tiles), A 4-5 (P halves), B 6-7 (V's dim tiles).
  template <int CH>
  __attribute__((target("amx-tile,amx-bf16"))) static void values(const Task& t, const uint16_t* p, float* o) {
    const int64_t chunks = t.Lp / KC, dim_tiles = 2 * CH, D = 32 * CH;
    for (int64_t dt = 0; dt < dim_tiles; dt += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kc = 0; kc < chunks; ++kc) {
        _tile_loadd(4, p + kc * 512, 64);
        _tile_loadd(5, p + (chunks + kc) * 512, 64);
        _tile_loadd(6, t.vp + (kc * dim_tiles + dt) * 256, 64);
        _tile_loadd(7, t.vp + (kc * dim_tiles + dt + 1) * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, o + 16 * dt, D * 4);
      _tile_stored(1, o + 16 * dt + 16, D * 4);
      _tile_stored(2, o + 16 * D + 16 * dt, D * 4);
      _tile_stored(3, o + 16 * D + 16 * dt + 16, D * 4);
    }
    asm volatile("" ::: "memory");
  }
};

}  // namespace

void encoder_attention_amx(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                           torch::Tensor& out, const int32_t* qs, const int32_t* ks, int64_t num_seqs, float scale) {
  TORCH_CHECK(encoder_attention_amx_takes(query), "encoder_attention_amx: needs bf16, D of 32 or 64 and AMX-BF16");
  encoder_bf16::run<TilePasses>(query, key, value, out, qs, ks, num_seqs, scale, /*causal=*/false);
}
#else
void encoder_attention_amx(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, torch::Tensor&,
                           const int32_t*, const int32_t*, int64_t, float) {
  TORCH_CHECK(false, "encoder_attention_amx: built without AMX support");
}
#endif
