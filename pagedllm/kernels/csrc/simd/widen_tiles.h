// Weight-only quantized tiles (quant_gemm.cpp), written once over the vector layer V (simd/vec_*.h): each 16-column
// panel is 16 / V::kLanes registers wide. Included by the ISA translation units only (see isa_kernels.h): no
// includes here, and everything is a template so that each ISA's instantiations are its own.
//
// Weight layouts, with scale/min float32 [P, K/group, 16]:
//   kQ8: int8 [P, K, 16], w = scale[g] * q
//   kQ4: uint8 [P, K/2, 16] (byte j of k pair t: low nibble k = 2t, high nibble k = 2t + 1), w = scale * q + min
//   kF8: uint8 [P, K, 16] float8 e4m3fn bits, w = scale * fp8(q); V::from_fp8 gives fp8(q) * 2^-8, so the
//        scale is taken times 2^8.
// A group's products are summed in float, then scaled once; the 4-bit minimum contributes min * sum(x over the
// group) from a per-call table of the group sums of x.

// int8 tiles prefetch 4 KiB ahead (a line every 4 k): one decode row streams the weight from memory, and the
// hardware prefetcher alone left the tied LM head of the default model at about half the memory bandwidth.
constexpr int64_t Q8_PREFETCH_BYTES = 4096;

template <class V, int F>
inline typename V::F group_scale(const WidenProblem& pb, int64_t o) {
  const typename V::F s = V::fload(pb.scales + o);
  return F == kF8 ? V::fmul(s, V::fset1(256.f)) : s;
}

// R rows (m0..) x 16 columns of panel p into tmp [R][16].
template <class V, int F, int R>
void widen_tile(const WidenProblem& pb, int64_t p, int64_t m0, float* tmp) {
  constexpr int kParts = NR / V::kLanes;
  constexpr int64_t kStep = F == kQ4 ? 2 : 1;  // k per 16-byte weight row
  using Vec = typename V::F;
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const float* xr = pb.x + m0 * pb.ldx;
  Vec acc[R][kParts];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < kParts; ++h) acc[i][h] = V::fzero();
  for (int64_t g = 0; g < pb.G; ++g) {
    Vec c[R][kParts];
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < kParts; ++h) c[i][h] = V::fzero();
    const int64_t k1 = (g + 1) * pb.group;
#pragma GCC unroll 2
    for (int64_t k = g * pb.group; k < k1; k += kStep) {
      const uint8_t* row = panel + (k / kStep) * NR;
      if (F == kQ8 && (k & 3) == 0) __builtin_prefetch(row + Q8_PREFETCH_BYTES, 0, 3);
      Vec w0[kParts], w1[kParts];  // w1: the odd k of a 4-bit pair
      for (int h = 0; h < kParts; ++h) {
        if constexpr (F == kQ4) V::from_u4(row + h * V::kLanes, w0[h], w1[h]);
        else if constexpr (F == kQ8) w0[h] = V::from_s8(reinterpret_cast<const int8_t*>(row) + h * V::kLanes);
        else w0[h] = V::from_fp8(row + h * V::kLanes);
      }
      for (int i = 0; i < R; ++i) {
        const Vec x0 = V::fset1(xr[i * pb.ldx + k]);
        for (int h = 0; h < kParts; ++h) c[i][h] = V::fmadd(x0, w0[h], c[i][h]);
        if constexpr (F == kQ4) {
          const Vec x1 = V::fset1(xr[i * pb.ldx + k + 1]);
          for (int h = 0; h < kParts; ++h) c[i][h] = V::fmadd(x1, w1[h], c[i][h]);
        }
      }
    }
    const int64_t o = (p * pb.G + g) * NR;
    for (int h = 0; h < kParts; ++h) {
      const Vec s = group_scale<V, F>(pb, o + h * V::kLanes);
      if constexpr (F == kQ4) {
        const Vec n = V::fload(pb.mins + o + h * V::kLanes);
        for (int i = 0; i < R; ++i)
          acc[i][h] = V::fmadd(c[i][h], s, V::fmadd(V::fset1(pb.xsum[(m0 + i) * pb.G + g]), n, acc[i][h]));
      } else {
        for (int i = 0; i < R; ++i) acc[i][h] = V::fmadd(c[i][h], s, acc[i][h]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < kParts; ++h) V::fstore(tmp + i * NR + h * V::kLanes, acc[i][h]);
}

// Panel p -> float [K, 16]: many rows then multiply it as fp32 weights.
template <class V, int F>
void dequant_panel(const WidenProblem& pb, int64_t p, float* dst) {
  constexpr int kParts = NR / V::kLanes;
  constexpr int64_t kStep = F == kQ4 ? 2 : 1;
  using Vec = typename V::F;
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  for (int64_t g = 0; g < pb.G; ++g) {
    const int64_t o = (p * pb.G + g) * NR;
    Vec s[kParts], n[kParts];
    for (int h = 0; h < kParts; ++h) {
      s[h] = group_scale<V, F>(pb, o + h * V::kLanes);
      n[h] = F == kQ4 ? V::fload(pb.mins + o + h * V::kLanes) : V::fzero();
    }
    for (int64_t k = g * pb.group; k < (g + 1) * pb.group; k += kStep) {
      const uint8_t* row = panel + (k / kStep) * NR;
      float* d = dst + k * NR;
      for (int h = 0; h < kParts; ++h) {
        if constexpr (F == kQ4) {
          Vec lo, hi;
          V::from_u4(row + h * V::kLanes, lo, hi);
          V::fstore(d + h * V::kLanes, V::fmadd(lo, s[h], n[h]));
          V::fstore(d + NR + h * V::kLanes, V::fmadd(hi, s[h], n[h]));
        } else {
          const Vec w = F == kQ8 ? V::from_s8(reinterpret_cast<const int8_t*>(row) + h * V::kLanes)
                                 : V::from_fp8(row + h * V::kLanes);
          V::fstore(d + h * V::kLanes, V::fmul(w, s[h]));
        }
      }
    }
  }
}

// R rows of x times a float panel [K, 16] into tmp [R][16], x read in place.
template <class V, int R>
void f32_tile(const float* x, int64_t ldx, const float* w, int64_t K, float* tmp) {
  constexpr int kParts = NR / V::kLanes;
  using Vec = typename V::F;
  Vec c[R][kParts];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < kParts; ++h) c[i][h] = V::fzero();
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[kParts];
    for (int h = 0; h < kParts; ++h) wv[h] = V::fload(w + k * NR + h * V::kLanes);
    for (int i = 0; i < R; ++i) {
      const Vec xv = V::fset1(x[i * ldx + k]);
      for (int h = 0; h < kParts; ++h) c[i][h] = V::fmadd(xv, wv[h], c[i][h]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < kParts; ++h) V::fstore(tmp + i * NR + h * V::kLanes, c[i][h]);
}

template <class V, int F, int... R>
constexpr WidenTile widen_tile_at(int r, std::integer_sequence<int, R...>) {
  constexpr WidenTile fns[] = {widen_tile<V, F, R + 1>...};
  return fns[r];
}

// The tiles of one ISA: 1..V::kWidenRows rows of each format; f32 tiles only when `with_f32`.
template <class V, bool with_f32>
constexpr WidenKernels widen_kernels() {
  WidenKernels k{};
  k.rows = V::kWidenRows;
  using Rows = std::make_integer_sequence<int, V::kWidenRows>;
  for (int r = 0; r < V::kWidenRows; ++r) {
    k.tiles[kQ8][r] = widen_tile_at<V, kQ8>(r, Rows{});
    k.tiles[kQ4][r] = widen_tile_at<V, kQ4>(r, Rows{});
    k.tiles[kF8][r] = widen_tile_at<V, kF8>(r, Rows{});
  }
  k.dequant[kQ8] = dequant_panel<V, kQ8>;
  k.dequant[kQ4] = dequant_panel<V, kQ4>;
  k.dequant[kF8] = dequant_panel<V, kF8>;
  if constexpr (with_f32) {
    constexpr F32Tile f32[] = {f32_tile<V, 1>, f32_tile<V, 2>, f32_tile<V, 3>, f32_tile<V, 4>,
                               f32_tile<V, 5>, f32_tile<V, 6>, f32_tile<V, 7>, f32_tile<V, 8>};
    for (int r = 0; r < kMaxWidenRows; ++r) k.f32[r] = f32[r];
  }
  return k;
}
