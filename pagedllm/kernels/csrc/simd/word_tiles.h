// The "words" tiles of the byte-dot-product weights (words_gemm.cpp): the same dot8 / dot4 panels, widened once per
// block of rows into int16 pairs, times x as one int16 term. Written once over the vector layer V (simd/vec_*.h)
// and included by the ISA translation units only (see isa_kernels.h): no includes here, and everything is a
// template.
//
// A panel's weights widened: int32 lanes [K/2][16], lane j of row i holding the levels of k = 2i (low 16 bits) and
// k = 2i + 1 (high) of column j: 4-bit levels as they are (0..15), 8-bit ones still offset by 128 (0..255; the
// offset comes out of the group sums, as in q8_dot_tile).

// One dot8 panel [K/8][64] -> int16 pairs [K/2][16]: block b's low nibbles are k = 8b..8b+3 of each column (byte t
// of the column's 32-bit lane), its high nibbles k = 8b+4..8b+7.
template <class V>
void widen_dot8_panel(const uint8_t* panel, int64_t K, int32_t* dst) {
  const typename V::B byte0 = V::bset1(0xFF), byte1 = V::bset1(0xFF00), byte2 = V::bset1(0xFF0000);
  for (int64_t b = 0; b < K / 8; ++b) {
    for (int h = 0; h < static_cast<int>(NR / V::kLanes); ++h) {
      const typename V::B v = V::bload(panel + b * 64 + 4 * V::kLanes * h);
      const typename V::B halves[2] = {V::low_nibbles(v), V::high_nibbles(v)};
      for (int half = 0; half < 2; ++half) {
        const typename V::B q = halves[half];  // bytes t = 0..3: the levels of k = 8b + 4 half + t
        const typename V::B p01 = V::bor(V::band(q, byte0), V::shl32(V::band(q, byte1), 8));
        const typename V::B p23 = V::bor(V::band(V::shr32(q, 16), byte0), V::band(V::shr32(q, 8), byte2));
        int32_t* row = dst + (4 * b + 2 * half) * NR + h * V::kLanes;
        V::bstore(row, p01);
        V::bstore(row + NR, p23);
      }
    }
  }
}

// One dot4 panel [K/4][64] (levels + 128) -> int16 pairs [K/2][16]: block b's byte t of a column is k = 4b + t.
template <class V>
void widen_dot4_panel(const uint8_t* panel, int64_t K, int32_t* dst) {
  const typename V::B even = V::bset1(0x00FF00FF);
  for (int64_t b = 0; b < K / 4; ++b) {
    for (int h = 0; h < static_cast<int>(NR / V::kLanes); ++h) {
      const typename V::B v = V::bload(panel + b * 64 + 4 * V::kLanes * h);
      const typename V::B u02 = V::band(v, even), u13 = V::band(V::shr32(v, 8), even);  // 16-bit words
      const typename V::B p01 = V::bor(V::band(u02, V::bset1(0xFFFF)), V::shl32(u13, 16));
      const typename V::B p23 = V::bor(V::shr32(u02, 16), V::band(u13, V::bset1(static_cast<int32_t>(0xFFFF0000))));
      int32_t* row = dst + 2 * b * NR + h * V::kLanes;
      V::bstore(row, p01);
      V::bstore(row + NR, p23);
    }
  }
}

// n float16 values -> float (n a multiple of 16).
template <class V>
void widen_halves(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += V::kLanes) V::fstore(dst + i, V::from_f16(src + i));
}

// A tile's rows acc [rows][width] (+ bias) -> y's columns [0, cols) of those rows (y rows ldy apart). `stream`:
// whole 64-byte lines past the caches, for an output much larger than them (the LM head's logits), whose rows,
// ldy * 4 bytes apart, would otherwise all fall in one cache set and evict the tile's own operands.
template <class V>
void store_rows(const float* acc, int rows, int64_t width, int64_t cols, const float* bias, float* y, int64_t ldy,
                bool stream) {
  for (int i = 0; i < rows; ++i) {
    float* yr = y + i * ldy;
    const float* r = acc + i * width;
    int64_t j = 0;
    if (stream && (reinterpret_cast<uintptr_t>(yr) % 64) == 0) {
      for (; j + V::kLanes <= cols; j += V::kLanes) {
        typename V::F v = V::fload(r + j);
        if (bias != nullptr) v = V::fadd(v, V::fload(bias + j));
        V::fstream(yr + j, v);
      }
    }
    for (; j < cols; ++j) yr[j] = bias != nullptr ? r[j] + bias[j] : r[j];
  }
  if (stream) V::stream_fence();
}

// R rows x (NP panels of 16 columns) from widened weights: per group, int32 sums D = sum_k q x16 by int16 pair
// dot products, then acc += s * D * dx' + min * sum x (4-bit weights, kNibbles) or s * (D - offset) * dx' (8-bit
// ones), acc float [R][NP * 16] in memory (which keeps the registers for the sums).
template <class V, int R, int NP, bool kNibbles>
void words_tile(const WordsProblem& problem, const WidenedPanels& w, int64_t m0, float* acc) {
  constexpr int kParts = NR / V::kLanes, kCols = NP * kParts;
  using Int = typename V::I;
  using Vec = typename V::F;
  const WordsProblem pb = problem;  // a local copy: the stores to acc would make the compiler reload its fields
  const int64_t KP = pb.K / 2, pairs_per_group = pb.group / 2, G = pb.G;
  for (int i = 0; i < R * NP * static_cast<int>(NR); ++i) acc[i] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    Int a[R][kCols];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < kCols; ++c) a[i][c] = V::izero();
#pragma GCC unroll 4
    for (int64_t kp = g * pairs_per_group; kp < (g + 1) * pairs_per_group; ++kp) {
      typename V::B wv[kCols];
      for (int c = 0; c < kCols; ++c)
        wv[c] = V::bload(reinterpret_cast<const uint8_t*>(w.q + ((c / kParts) * KP + kp) * NR + (c % kParts) * V::kLanes));
      for (int i = 0; i < R; ++i) {
        int32_t word;
        __builtin_memcpy(&word, pb.x16 + (m0 + i) * pb.K + 2 * kp, 4);
        const typename V::B xb = V::bset1(word);
        for (int c = 0; c < kCols; ++c) a[i][c] = V::dot_s16(a[i][c], xb, wv[c]);
      }
    }
    for (int c = 0; c < kCols; ++c) {
      const int64_t o = ((c / kParts) * G + g) * NR + (c % kParts) * V::kLanes;
      const Vec s = V::fload(w.scales + o);
      for (int i = 0; i < R; ++i) {
        const int64_t ro = (m0 + i) * G + g;
        float* f = acc + i * NP * NR + c * V::kLanes;
        Vec prev = V::fload(f);
        Int d = a[i][c];
        if constexpr (kNibbles) prev = V::fmadd(V::fload(w.mins + o), V::fset1(pb.s[ro]), prev);
        else d = V::isub(d, V::iset1(pb.offsets[ro]));
        V::fstore(f, V::fmadd(V::fmul(V::to_float(d), V::fset1(pb.dx[ro])), s, prev));
      }
    }
  }
}

template <class V, int NP, bool kNibbles, int... R>
constexpr WordsTile words_tile_at(int r, std::integer_sequence<int, R...>) {
  constexpr WordsTile fns[] = {words_tile<V, R + 1, NP, kNibbles>...};
  return fns[r];
}

// The words tiles of one ISA: 1..R rows of 1..NP panels.
template <class V, int R, int NP>
constexpr WordKernels word_kernels() {
  static_assert(R <= kMaxWordRows && NP <= kMaxWordPanels, "see isa_kernels.h");
  WordKernels k{};
  k.rows = R;
  k.panels = NP;
  k.widen_dot8 = widen_dot8_panel<V>;
  k.widen_dot4 = widen_dot4_panel<V>;
  k.widen_halves = widen_halves<V>;
  k.store_rows = store_rows<V>;
  using Rows = std::make_integer_sequence<int, R>;
  for (int r = 0; r < R; ++r) {
    k.q4[0][r] = words_tile_at<V, 1, true>(r, Rows{});
    k.q8[0][r] = words_tile_at<V, 1, false>(r, Rows{});
    if constexpr (NP >= 2) {
      k.q4[1][r] = words_tile_at<V, NP, true>(r, Rows{});
      k.q8[1][r] = words_tile_at<V, NP, false>(r, Rows{});
    }
  }
  return k;
}
