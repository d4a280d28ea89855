// The vector layer in portable C++: one lane, so a tile's loop over lanes is its loop over columns. Included
// only by isa_generic.cpp (see isa_kernels.h); it serves CPUs without AVX2 and the tests' reference paths.
struct Scalar {
  static constexpr int kLanes = 1;
  static constexpr int kWidenRows = 8;
  using F = float;
  using I = int32_t;
  using B = uint32_t;  // 4 bytes of one column

  static F fzero() { return 0.f; }
  static F fload(const float* p) { return *p; }
  static void fstore(float* p, F v) { *p = v; }
  static void fstream(float* p, F v) { *p = v; }
  static void stream_fence() {}
  static F fset1(float v) { return v; }
  static F fmadd(F a, F b, F c) { return a * b + c; }
  static F fmsub(F a, F b, F c) { return std::fma(a, b, -c); }  // fused in every path (dot_gemm.h's residual)
  static F fmul(F a, F b) { return a * b; }
  static F fadd(F a, F b) { return a + b; }
  static F fmax(F a, F b) { return std::max(a, b); }
  static F fmin(F a, F b) { return std::min(a, b); }
  static F fabs(F a) { return std::fabs(a); }
  static F fround(F a) { return std::nearbyint(a); }
  static float freduce_max(F a) { return a; }
  static float freduce_add(F a) { return a; }

  static F from_s8(const int8_t* p) { return static_cast<float>(*p); }
  static void from_u4(const uint8_t* p, F& lo, F& hi) {
    lo = static_cast<float>(*p & 15);
    hi = static_cast<float>(*p >> 4);
  }
  // float8 e4m3fn (sign, 4-bit exponent with bias 7, 3-bit mantissa; exponent 0: subnormal) -> value * 2^-8.
  static F from_fp8(const uint8_t* p) {
    const int e = (*p >> 3) & 15, m = *p & 7;
    const float v = e == 0 ? std::ldexp(static_cast<float>(m), -17) : std::ldexp(static_cast<float>(8 + m), e - 18);
    return (*p & 128) ? -v : v;
  }
  static F from_f16(const uint16_t* p) { return c10::detail::fp16_ieee_to_fp32_value(*p); }

  static I izero() { return 0; }
  static I iset1(int32_t v) { return v; }
  static I iadd(I a, I b) { return a + b; }
  static I isub(I a, I b) { return a - b; }
  static I iload(const int32_t* p) { return *p; }
  static F to_float(I a) { return static_cast<float>(a); }
  static I to_int(F a) { return static_cast<int32_t>(std::nearbyint(a)); }
  static int32_t ireduce_add(I a) { return a; }
  static void store_s8(int8_t* p, I a) { *p = static_cast<int8_t>(a); }

  static B bload(const uint8_t* p) {
    B b;
    std::memcpy(&b, p, 4);
    return b;
  }
  static B bset1(int32_t word) { return static_cast<B>(word); }
  static B low_nibbles(B b) { return b & 0x0F0F0F0Fu; }
  static B band(B a, B b) { return a & b; }
  static B bor(B a, B b) { return a | b; }
  static B shl32(B a, int n) { return a << n; }
  static B shr32(B a, int n) { return a >> n; }
  static void bstore(int32_t* p, B b) { std::memcpy(p, &b, 4); }
  static I dot_s16(I acc, B a, B b) {
    return acc + static_cast<int16_t>(a & 0xFFFF) * static_cast<int16_t>(b & 0xFFFF) +
           static_cast<int16_t>(a >> 16) * static_cast<int16_t>(b >> 16);
  }
  static B high_nibbles(B b) { return (b >> 4) & 0x0F0F0F0Fu; }
  static I dot_u8s8(I acc, B u, B s) {
    for (int t = 0; t < 4; ++t)
      acc += static_cast<int32_t>((u >> (8 * t)) & 255) * static_cast<int8_t>((s >> (8 * t)) & 255);
    return acc;
  }

  struct NibbleSums {
    I s;
  };
  static NibbleSums nibble_zero() { return {0}; }
  template <bool kShort>
  static void nibble_add(NibbleSums& s, B lo, B hi, B x_lo, B x_hi) {
    s.s = dot_u8s8(dot_u8s8(s.s, lo, x_lo), hi, x_hi);
  }
  template <bool kShort>
  static I nibble_total(NibbleSums s) { return s.s; }
};
