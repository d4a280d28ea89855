// Byte-dot-product tiles (q4_dot_gemm.cpp, q8_dot_gemm.cpp, w8a8_gemm.cpp) and the activation split they read,
// written once over the vector layer V (simd/vec_*.h). A 64-byte weight block holds 4 bytes of each of 16 columns;
// column part h (V::kLanes columns) is its bytes [4 kLanes h, 4 kLanes (h + 1)). Included by the ISA translation
// units only (see isa_kernels.h): no includes here, and everything is a template.
//
// Every tile scales a group's integer sums as dot_gemm::add_scaled_sums does (the AMX kernel's too), so that a
// choice between tiles changes speed only: f + s * (dx * d1 + dx / 254 * d2).

// Software prefetch distances. A decode step's matmuls are small (0.2-1.1 MB each) and stream from memory, so the
// hardware prefetcher, restarting at every call, leaves one stream per core latency-bound.
constexpr int64_t Q4_PREFETCH_BLOCKS = 96;  // 6 KiB: the default model's 120 decode matmuls 2.1 -> 1.65 ms
constexpr int64_t Q4_PREFETCH_GROUPS = 16;  // scales and mins, 32 bytes each per group
constexpr int64_t Q8_PREFETCH_BLOCKS = 64;  // 4 KiB
constexpr int32_t Q8_OFFSET = 128;          // "dot4" stores q + 128: vpdpbusd multiplies unsigned weight bytes

// x1, x2 of one group of one row (dot_gemm.h): kLanes k at a time, the tail by the scalar loops every path shares,
// rounding as they do (to nearest, ties to even; the residual through a fused multiply-add).
template <class V>
GroupStats split_group(const float* r, int64_t group, int8_t* q1, int8_t* q2) {
  using Vec = typename V::F;
  const int64_t vec = group / V::kLanes * V::kLanes;
  Vec vmax = V::fzero(), vsum = V::fzero();
  for (int64_t k = 0; k < vec; k += V::kLanes) {
    const Vec v = V::fload(r + k);
    vmax = V::fmax(vmax, V::fabs(v));
    vsum = V::fadd(vsum, v);
  }
  float amax = V::freduce_max(vmax), sum = V::freduce_add(vsum);
  dot_gemm::scan_range(r, vec, group, amax, sum);
  const float inv = dot_gemm::inverse_step(amax);
  const Vec vinv = V::fset1(inv), steps = V::fset1(dot_gemm::RESIDUAL_STEPS);
  const Vec lo = V::fset1(-127.f), hi = V::fset1(127.f);
  typename V::I c1 = V::izero(), c2 = V::izero();
  for (int64_t k = 0; k < vec; k += V::kLanes) {
    const Vec x = V::fload(r + k);
    const Vec l1 = V::fround(V::fmul(x, vinv));
    const Vec l2 = V::fmin(hi, V::fmax(lo, V::fround(V::fmul(V::fmsub(x, vinv, l1), steps))));
    const typename V::I i1 = V::to_int(l1), i2 = V::to_int(l2);
    V::store_s8(q1 + k, i1);
    V::store_s8(q2 + k, i2);
    c1 = V::iadd(c1, i1);
    c2 = V::iadd(c2, i2);
  }
  int32_t s1 = V::ireduce_add(c1), s2 = V::ireduce_add(c2);
  dot_gemm::split_range(r, vec, group, inv, q1, q2, s1, s2);
  return {amax / 127.f, sum, s1, s2};
}

// The 4-byte word of x1 or x2 at row m, k.
inline int32_t x_word(const int8_t* x, int64_t off) {
  int32_t w;
  __builtin_memcpy(&w, x + off, 4);
  return w;
}

// f + s * (dx * d1 + dx / 254 * d2) for one part of a row's 16 outputs.
template <class V>
typename V::F add_scaled_sums(typename V::F f, typename V::I d1, typename V::I d2, float dx, typename V::F s) {
  typename V::F t = V::fmul(V::to_float(d1), V::fset1(dx));
  t = V::fmadd(V::to_float(d2), V::fset1(dx / dot_gemm::RESIDUAL_STEPS), t);
  return V::fmadd(t, s, f);
}

// A tile's float results across groups: with one column part (AVX-512) they stay in registers; with two (AVX2:
// 2R sums and 2 weight registers already fill its 16) they add into acc in memory after each group.
template <class V, int R>
struct GroupResults {
  static constexpr bool kInRegisters = NR / V::kLanes == 1;
  typename V::F f[R];
  float* acc;
  explicit GroupResults(float* out) : acc(out) {
    for (int i = 0; i < R; ++i) f[i] = V::fzero();
    if constexpr (!kInRegisters)
      for (int i = 0; i < R * static_cast<int>(NR); ++i) acc[i] = 0.f;
  }
  typename V::F get(int i, int h) const { return kInRegisters ? f[i] : V::fload(acc + i * NR + h * V::kLanes); }
  void set(int i, int h, typename V::F v) {
    if constexpr (kInRegisters) f[i] = v;
    else V::fstore(acc + i * NR + h * V::kLanes, v);
  }
  void finish() {
    if constexpr (kInRegisters)
      for (int i = 0; i < R; ++i) V::fstore(acc + i * NR, f[i]);
  }
};

// 4-bit weights, "dot8" layout [P, K/8, 64]: byte 4j + t of block b holds q[8b + t, j] in its low nibble and
// q[8b + 4 + t, j] in its high nibble; float16 scales and mins [P, G, 16]. R rows x 16 columns into acc, one
// column part at a time over a group (GroupResults). The tile reads a local copy of pb: the compiler cannot tell
// that the stores to acc leave pb's fields be, and reloaded them after each one.
template <class V, int R, bool kShort>
void q4_dot_tile(const DotProblem& problem, int64_t p, int64_t m0, float* acc) {
  constexpr int kParts = NR / V::kLanes;
  constexpr int64_t kBlockK = 8, kBlockBytes = 64;
  using Vec = typename V::F;
  const DotProblem pb = problem;
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const uint16_t* scales = static_cast<const uint16_t*>(pb.scales);
  const int64_t G = pb.G, blocks_per_group = pb.group / kBlockK;
  GroupResults<V, R> out(acc);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t o = (p * G + g) * NR;
    __builtin_prefetch(scales + o + Q4_PREFETCH_GROUPS * NR, 0, 3);  // prefetches never fault past the end
    __builtin_prefetch(pb.mins + o + Q4_PREFETCH_GROUPS * NR, 0, 3);
    for (int h = 0; h < kParts; ++h) {
      typename V::NibbleSums c1[R], c2[R];
      for (int i = 0; i < R; ++i) c1[i] = c2[i] = V::nibble_zero();
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const uint8_t* blk = panel + b * kBlockBytes;
        if (h == 0) __builtin_prefetch(blk + Q4_PREFETCH_BLOCKS * kBlockBytes, 0, 3);
        const typename V::B v = V::bload(blk + 4 * V::kLanes * h);
        const typename V::B lo = V::low_nibbles(v), hi = V::high_nibbles(v);
        for (int i = 0; i < R; ++i) {
          const int64_t off = (m0 + i) * pb.K + b * kBlockK;
          V::template nibble_add<kShort>(c1[i], lo, hi, V::bset1(x_word(pb.x1, off)),
                                         V::bset1(x_word(pb.x1, off + 4)));
          V::template nibble_add<kShort>(c2[i], lo, hi, V::bset1(x_word(pb.x2, off)),
                                         V::bset1(x_word(pb.x2, off + 4)));
        }
      }
      const Vec s = V::from_f16(scales + o + h * V::kLanes), n = V::from_f16(pb.mins + o + h * V::kLanes);
      for (int i = 0; i < R; ++i) {
        const int64_t ro = (m0 + i) * G + g;
        const Vec prev = V::fmadd(n, V::fset1(pb.s[ro]), out.get(i, h));
        out.set(i, h, add_scaled_sums<V>(prev, V::template nibble_total<kShort>(c1[i]),
                                         V::template nibble_total<kShort>(c2[i]), pb.d[ro], s));
      }
    }
  }
  out.finish();
}

// 8-bit weights, "dot4" layout [P, K/4, 64]: byte 4j + t of block b holds q[4b + t, j] + 128; the offset comes out
// through the integer sums of x1 and x2 per group. Even and odd blocks sum into separate registers: the byte dot
// product's latency (~5 cycles) would otherwise chain every product of a row. Results across groups as in
// q4_dot_tile.
template <class V, int R, bool kHalf>
void q8_dot_tile(const DotProblem& problem, int64_t p, int64_t m0, float* acc) {
  constexpr int kParts = NR / V::kLanes;
  constexpr int64_t kBlockK = 4, kBlockBytes = 64;
  using Vec = typename V::F;
  using Int = typename V::I;
  const DotProblem pb = problem;  // a local copy, as in q4_dot_tile
  const uint8_t* panel = pb.w + p * pb.panel_bytes;
  const int64_t G = pb.G, blocks_per_group = pb.group / kBlockK;
  GroupResults<V, R> out(acc);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t o = (p * G + g) * NR, bend = (g + 1) * blocks_per_group;
    for (int h = 0; h < kParts; ++h) {
      Int a1[R], a2[R], b1[R], b2[R];
      for (int i = 0; i < R; ++i) a1[i] = a2[i] = b1[i] = b2[i] = V::izero();
      int64_t b = g * blocks_per_group;
      for (; b + 1 < bend; b += 2) {
        if (h == 0) __builtin_prefetch(panel + (b + Q8_PREFETCH_BLOCKS) * kBlockBytes, 0, 3);
        const typename V::B w0 = V::bload(panel + b * kBlockBytes + 4 * V::kLanes * h);
        const typename V::B w1 = V::bload(panel + (b + 1) * kBlockBytes + 4 * V::kLanes * h);
        for (int i = 0; i < R; ++i) {
          const int64_t off = (m0 + i) * pb.K + b * kBlockK;
          a1[i] = V::dot_u8s8(a1[i], w0, V::bset1(x_word(pb.x1, off)));
          a2[i] = V::dot_u8s8(a2[i], w0, V::bset1(x_word(pb.x2, off)));
          b1[i] = V::dot_u8s8(b1[i], w1, V::bset1(x_word(pb.x1, off + 4)));
          b2[i] = V::dot_u8s8(b2[i], w1, V::bset1(x_word(pb.x2, off + 4)));
        }
      }
      if (b < bend) {  // an odd number of blocks per group
        const typename V::B w0 = V::bload(panel + b * kBlockBytes + 4 * V::kLanes * h);
        for (int i = 0; i < R; ++i) {
          const int64_t off = (m0 + i) * pb.K + b * kBlockK;
          a1[i] = V::dot_u8s8(a1[i], w0, V::bset1(x_word(pb.x1, off)));
          a2[i] = V::dot_u8s8(a2[i], w0, V::bset1(x_word(pb.x2, off)));
        }
      }
      const Vec s = kHalf ? V::from_f16(static_cast<const uint16_t*>(pb.scales) + o + h * V::kLanes)
                          : V::fload(static_cast<const float*>(pb.scales) + o + h * V::kLanes);
      for (int i = 0; i < R; ++i) {
        const int64_t ro = (m0 + i) * G + g;
        const Int d1 = V::isub(V::iadd(a1[i], b1[i]), V::iset1(Q8_OFFSET * pb.s1[ro]));
        const Int d2 = V::isub(V::iadd(a2[i], b2[i]), V::iset1(Q8_OFFSET * pb.s2[ro]));
        out.set(i, h, add_scaled_sums<V>(out.get(i, h), d1, d2, pb.d[ro], s));
      }
    }
  }
  out.finish();
}

// W8A8: R rows of x (u8, +128) times one panel regrouped into k-quads [Kp/4, 16, 4] into tmp [R][16]; colsum128
// holds 128 * sum_k w per column, the offset's contribution.
template <class V, int R>
void w8a8_tile(const uint8_t* xq, int64_t Kp, const int8_t* quads, const int32_t* colsum128, const float* sx,
               const float* sw, float* tmp) {
  constexpr int kParts = NR / V::kLanes;
  using Int = typename V::I;
  Int acc[R][kParts];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < kParts; ++h) acc[i][h] = V::izero();
  const int64_t nq = Kp / 4;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(quads);
#pragma GCC unroll 4
  for (int64_t q = 0; q < nq; ++q) {
    typename V::B wv[kParts];
    for (int h = 0; h < kParts; ++h) wv[h] = V::bload(w + q * 64 + 4 * V::kLanes * h);
    for (int i = 0; i < R; ++i) {
      const typename V::B xv = V::bset1(x_word(reinterpret_cast<const int8_t*>(xq), i * Kp + q * 4));
      for (int h = 0; h < kParts; ++h) acc[i][h] = V::dot_u8s8(acc[i][h], xv, wv[h]);
    }
  }
  for (int h = 0; h < kParts; ++h) {
    const Int corr = V::iload(colsum128 + h * V::kLanes);
    const typename V::F swv = V::fload(sw + h * V::kLanes);
    for (int i = 0; i < R; ++i) {
      const typename V::F v = V::to_float(V::isub(acc[i][h], corr));
      V::fstore(tmp + i * NR + h * V::kLanes, V::fmul(V::fmul(v, V::fset1(sx[i])), swv));
    }
  }
}

// The byte-dot tiles of one ISA. `full_bytes`: the ISA has an exact u8 x s8 dot product (8-bit weights, W8A8).
template <class V, bool full_bytes, bool with_w8a8>
constexpr DotKernels dot_kernels() {
  DotKernels k{};
  k.split_group = split_group<V>;
  constexpr DotTile q4[] = {q4_dot_tile<V, 1, false>, q4_dot_tile<V, 2, false>, q4_dot_tile<V, 3, false>,
                            q4_dot_tile<V, 4, false>};
  constexpr DotTile q4s[] = {q4_dot_tile<V, 1, true>, q4_dot_tile<V, 2, true>, q4_dot_tile<V, 3, true>,
                             q4_dot_tile<V, 4, true>};
  for (int r = 0; r < kDotRows; ++r) k.q4[r] = q4[r], k.q4_short[r] = q4s[r];
  if constexpr (full_bytes) {
    constexpr DotTile q8h[] = {q8_dot_tile<V, 1, true>, q8_dot_tile<V, 2, true>, q8_dot_tile<V, 3, true>,
                               q8_dot_tile<V, 4, true>};
    constexpr DotTile q8f[] = {q8_dot_tile<V, 1, false>, q8_dot_tile<V, 2, false>, q8_dot_tile<V, 3, false>,
                               q8_dot_tile<V, 4, false>};
    for (int r = 0; r < kDotRows; ++r) k.q8_half[r] = q8h[r], k.q8_float[r] = q8f[r];
  }
  if constexpr (with_w8a8) {
    constexpr W8a8Tile w[] = {w8a8_tile<V, 1>, w8a8_tile<V, 2>, w8a8_tile<V, 3>, w8a8_tile<V, 4>,
                              w8a8_tile<V, 5>, w8a8_tile<V, 6>, w8a8_tile<V, 7>, w8a8_tile<V, 8>};
    for (int r = 0; r < kW8a8Rows; ++r) k.w8a8[r] = w[r];
  }
  return k;
}
