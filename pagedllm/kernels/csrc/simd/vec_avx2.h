// The vector layer on AVX2 + FMA + F16C: 8 float lanes. Included only by isa_avx2.cpp, inside its
// `#pragma GCC target` region and an anonymous namespace (see isa_kernels.h).
struct Avx2 {
  static constexpr int kLanes = 8;
  static constexpr int kWidenRows = 6;  // 6 rows x 2 accumulators + 2 weights + a broadcast fit 16 registers
  using F = __m256;
  using I = __m256i;
  using B = __m256i;

  static F fzero() { return _mm256_setzero_ps(); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static void fstore(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void fstream(float* p, F v) { _mm256_stream_ps(p, v); }  // p 32-byte aligned; past the caches
  static void stream_fence() { _mm_sfence(); }  // streamed stores visible before the call returns
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmax(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmin(F a, F b) { return _mm256_min_ps(a, b); }
  static F fabs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
  static F fround(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static float freduce_max(F a) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, a);
    float m = lanes[0];
    for (int i = 1; i < 8; ++i) m = m > lanes[i] ? m : lanes[i];
    return m;
  }
  static float freduce_add(F a) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, a);
    float s = 0.f;
    for (float v : lanes) s += v;
    return s;
  }

  static F from_s8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void from_u4(const uint8_t* p, F& lo, F& hi) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), low = _mm_set1_epi8(15);
    lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, low)));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)));
  }
  // kLanes float8 e4m3fn bytes -> value * 2^-8 (each byte in the high half of a 16-bit lane, shifted right once).
  static F from_fp8(const uint8_t* p) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i keep = _mm_set1_epi16(static_cast<int16_t>(0xBFFF));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), b), 1), keep));
  }
  static F from_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }

  static I izero() { return _mm256_setzero_si256(); }
  static I iset1(int32_t v) { return _mm256_set1_epi32(v); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I iload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static I to_int(F a) { return _mm256_cvtps_epi32(a); }
  static int32_t ireduce_add(I a) {
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
    int32_t s = 0;
    for (int32_t v : lanes) s += v;
    return s;
  }
  // 8 int32 in -127..127 -> 8 int8 (the packs never saturate).
  static void store_s8(int8_t* p, I a) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }

  static B bload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static B bset1(int32_t word) { return _mm256_set1_epi32(word); }
  static B low_nibbles(B b) { return _mm256_and_si256(b, _mm256_set1_epi8(15)); }
  static B band(B a, B b) { return _mm256_and_si256(a, b); }
  static B bor(B a, B b) { return _mm256_or_si256(a, b); }
  static B shl32(B a, int n) { return _mm256_slli_epi32(a, n); }
  static B shr32(B a, int n) { return _mm256_srli_epi32(a, n); }
  static void bstore(int32_t* p, B b) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b); }
  // acc + the sum of each lane's 2 products of int16 words (vpmaddwd: exact, as |q x16| < 2^24 here).
  static I dot_s16(I acc, B a, B b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  static B high_nibbles(B b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(15)); }

  // Nibble x int8 sums without VNNI: vpmaddubsw (pairs into int16) + vpmaddwd (pairs of int16 into int32), both on
  // the multiply port. A block's products fit int16 (2 * 15 * 127 per pair, low and high nibbles together 7620),
  // so kShort (groups of at most 4 blocks, GGUF's 32 k) sums the blocks in int16 and widens once at the end: 9
  // multiplies per row and block instead of 12. The sums are exact integers either way.
  struct NibbleSums {
    I s;
  };
  static NibbleSums nibble_zero() { return {izero()}; }
  template <bool kShort>
  static void nibble_add(NibbleSums& s, B lo, B hi, B x_lo, B x_hi) {
    const I pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi));
    if constexpr (kShort) s.s = _mm256_add_epi16(s.s, pairs);
    else s.s = _mm256_add_epi32(s.s, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  template <bool kShort>
  static I nibble_total(NibbleSums s) {
    if constexpr (kShort) return _mm256_madd_epi16(s.s, _mm256_set1_epi16(1));
    else return s.s;
  }
  // No exact byte dot product of full-range unsigned bytes: vpmaddubsw saturates int16 at 2 * 255 * 127.
  static I dot_u8s8(I acc, B u, B s);  // declared only
};
