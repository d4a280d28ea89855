// The vector layer on AVX-512F/BW/VL (with F16C and FMA): 16 float lanes. Included only by isa_avx512.cpp and
// isa_vnni512.cpp, inside their `#pragma GCC target` region and an anonymous namespace (see isa_kernels.h).
// The byte dot product (vpdpbusd) is the one member that needs VNNI: only isa_vnni512.cpp instantiates it.
struct Avx512 {
  static constexpr int kLanes = 16;    // float / int32 lanes of one register
  static constexpr int kWidenRows = 8;  // rows of a widening tile: 8 x 1 accumulators + weights fit 32 registers
  using F = __m512;
  using I = __m512i;
  using B = __m512i;  // 4 bytes per int32 lane: the operand of a byte dot product

  static F fzero() { return _mm512_setzero_ps(); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void fstream(float* p, F v) { _mm512_stream_ps(p, v); }  // p 64-byte aligned; past the caches
  static void stream_fence() { _mm_sfence(); }  // streamed stores visible before the call returns
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmax(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmin(F a, F b) { return _mm512_min_ps(a, b); }
  static F fabs(F a) { return _mm512_abs_ps(a); }
  static F fround(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static float freduce_max(F a) { return _mm512_reduce_max_ps(a); }
  static float freduce_add(F a) { return _mm512_reduce_add_ps(a); }

  // Widening loads of kLanes weights.
  static F from_s8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // kLanes bytes -> their low and high nibbles.
  static void from_u4(const uint8_t* p, F& lo, F& hi) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), low = _mm_set1_epi8(15);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)));
  }
  // kLanes float8 e4m3fn bytes -> value * 2^-8 (s eeee mmm placed as the float16 s 0 eeee mmm 0000000).
  static F from_fp8(const uint8_t* p) {
    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0xBFFF));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(h, 8), 1), keep));
  }
  static F from_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  static I izero() { return _mm512_setzero_si512(); }
  static I iset1(int32_t v) { return _mm512_set1_epi32(v); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I iload(const int32_t* p) { return _mm512_loadu_si512(p); }
  static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static I to_int(F a) { return _mm512_cvtps_epi32(a); }  // rounds to nearest (the default MXCSR mode)
  static int32_t ireduce_add(I a) { return _mm512_reduce_add_epi32(a); }
  static void store_s8(int8_t* p, I a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a)); }

  static B bload(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static B bset1(int32_t word) { return _mm512_set1_epi32(word); }  // 4 bytes repeated in every lane
  static B low_nibbles(B b) { return _mm512_and_si512(b, _mm512_set1_epi8(15)); }
  static B band(B a, B b) { return _mm512_and_si512(a, b); }
  static B bor(B a, B b) { return _mm512_or_si512(a, b); }
  static B shl32(B a, int n) { return _mm512_slli_epi32(a, n); }
  static B shr32(B a, int n) { return _mm512_srli_epi32(a, n); }
  static void bstore(int32_t* p, B b) { _mm512_storeu_si512(p, b); }
  static B high_nibbles(B b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(15)); }

  // Sums of nibble x int8 products, per int32 lane. Low and high nibbles sum into separate registers: vpdpbusd's
  // latency (~5 cycles) would otherwise chain every dot product of a row. kShort changes nothing here.
  struct NibbleSums {
    I lo, hi;
  };
  static NibbleSums nibble_zero() { return {izero(), izero()}; }
  template <bool kShort>
  static void nibble_add(NibbleSums& s, B lo, B hi, B x_lo, B x_hi) {
    s.lo = dot_u8s8(s.lo, lo, x_lo);
    s.hi = dot_u8s8(s.hi, hi, x_hi);
  }
  template <bool kShort>
  static I nibble_total(NibbleSums s) { return iadd(s.lo, s.hi); }

  // acc + the sum of each lane's 4 products of u (unsigned bytes) by s (signed bytes), exact in int32. Only
  // isa_vnni512.cpp (built for VNNI) defines it; a byte-dot tile instantiated elsewhere would not link.
  static I dot_u8s8(I acc, B u, B s);
  // acc + the sum of each lane's 2 products of int16 words, exact in int32 (vpdpwssd with VNNI, else vpmaddwd).
  static I dot_s16(I acc, B a, B b);
};
