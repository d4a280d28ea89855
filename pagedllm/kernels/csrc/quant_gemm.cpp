// Weight-only quantized matmuls: y[M, N] = x[M, K] @ dequant(W)^T (+ bias), x and y float32.
//
// Weights are repacked once at load time into panels of 16 output columns (like packed_gemm.cpp) so the
// inner loop reads one contiguous stream per panel and widens 16 weights per k into vector lanes:
//   q8: int8 [P, K, 16], w = scale[g] * q                        (int8 per channel, GGUF Q8_0, 8-bit GPTQ)
//   q4: uint8 [P, K/2, 16] (byte j of k pair t: low nibble k = 2t, high nibble k = 2t + 1),
//       w = scale[g] * q + min[g]                                (int4, GGUF Q4_0/Q4_1, 4-bit GPTQ/AWQ)
//   f8: uint8 [P, K, 16] float8 e4m3fn bit patterns, w = scale[g] * fp8(q)   (fp8 per channel or block)
// with scale/min float32 [P, K/group, 16]. The tiles are simd/widen_tiles.h's, chosen per call by
// isa::kernels_for (isa: 0 = best available, 1 = AVX2+FMA+F16C, 2 = AVX-512F/BW/VL, 3 = portable C++), so one
// build serves every CPU kind and tests can force every path on one machine.
//
// Few rows (decode): the tiles widen the weights in registers, bound by the weights' bytes. From
// DEQUANT_MIN_ROWS rows on, each panel is instead dequantized into a float buffer and multiplied in float, so
// many rows cost what fp32 weights cost: by the ISA's f32 tiles reading x in place where it has them (AVX-512),
// elsewhere by packed_gemm.cpp's fp32 panel kernel on x packed once per call (packed_panels.h).
//
// fp8 -> float in registers: the byte s eeee mmm placed in a 16-bit lane as s 0 eeee mmm 0000000 is the
// float16 of value * 2^-8 (normals and subnormals alike: e4m3's exponent bias 7 vs float16's 15), which
// F16C / AVX-512 convert to float exactly; the 2^8 goes into the scale. e4m3fn's NaN pattern (s 1111 111)
// reads as +-480: quantizers clamp to +-448 and never produce it.
#include "cpu_features.h"
#include "gemm_args.h"
#include "isa_kernels.h"
#include "kernels.h"
#include "packed_panels.h"
#include "tile_loop.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t NR = isa::NR;
// Past one register tile of rows, widening every weight once per row tile costs more than the multiply-adds.
constexpr int64_t DEQUANT_MIN_ROWS = 9;  // one 8-row AVX-512 tile still reads the weights directly
constexpr int64_t MIN_WORK = int64_t{1} << 16;  // multiply-adds a thread: widening makes a panel dearer than fp32
thread_local std::vector<float> t_panel;  // the running thread's dequantized panel [K, 16]

// Many rows without f32 tiles: dequantized panel x the fp32 panel kernel (packed_gemm.cpp) on x packed once per
// call, panels [p0, p1).
void many_rows_packed(isa::DequantPanel dequant, const isa::WidenProblem& pb, const float* xt, int64_t M, int64_t N,
                      const float* bias, float* y, int64_t ldy, int64_t p0, int64_t p1) {
  t_panel.resize(static_cast<size_t>(pb.K * NR));
  const int64_t kc = packed_gemm_k_chunk(pb.K);
  const int64_t mblock = packed_gemm_row_block(pb.K);
  for (int64_t mb = 0; mb < M; mb += mblock) {
    const int64_t rows = std::min(mblock, M - mb);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
      dequant(pb, p, t_panel.data());
      panel_rows_packed_x(xt + mb * pb.K, rows, t_panel.data(), pb.K, kc, cols, bias != nullptr ? bias + n0 : nullptr,
                          y + mb * ldy + n0, ldy);
    }
  }
}

torch::Tensor quant_gemm(isa::Format fmt, const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                         const std::optional<torch::Tensor>& mins, int64_t group, int64_t out_features,
                         const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                         int64_t isa_request) {
  const bool q4 = fmt == isa::kQ4;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K > 0, "x has no columns");
  TORCH_CHECK(group > 0 && K % group == 0 && (!q4 || group % 2 == 0),
              "group ", group, " must divide K = ", K, q4 ? " and be even" : "");
  const int64_t P = (N + NR - 1) / NR, G = K / group;
  TORCH_CHECK(N > 0, "out_features must be positive");
  const int64_t rows_per_panel = q4 ? K / 2 : K;
  const auto qtype = fmt == isa::kQ8 ? torch::kInt8 : torch::kUInt8;
  const char* layout = q4 ? "uint8 [P, K/2, 16]" : fmt == isa::kQ8 ? "int8 [P, K, 16]" : "uint8 [P, K, 16]";
  TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 3 && qweight.size(0) == P &&
              qweight.size(1) == rows_per_panel && qweight.size(2) == NR && qweight.scalar_type() == qtype,
              "qweight must be contiguous ", layout, " with P = ", P, ", K = ", K, "; got ", qweight.sizes());
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == P * G * NR,
              "scales must be contiguous float32 [P, K/group, 16]");
  if (q4) {
    TORCH_CHECK(mins.has_value() && mins->is_contiguous() && mins->scalar_type() == torch::kFloat32 &&
                mins->numel() == P * G * NR, "mins must be contiguous float32 [P, K/group, 16]");
  }
  const torch::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  torch::Tensor bc;
  const float* b = gemm_bias(bias, N, bc);
  torch::Tensor y = gemm_output(out, M, N, x.options());
  if (M == 0) return y;
  const isa::WidenKernels& kernels = *isa::kernels_for(isa_request).widen;
  const bool dequant = M >= DEQUANT_MIN_ROWS;
  const bool packed_x = dequant && kernels.f32[0] == nullptr;
  torch::Tensor xsum, xt;
  if (q4 && !dequant) xsum = xc.reshape({M, G, group}).sum(-1).contiguous();
  const int64_t ldx = xc.stride(0);
  const float* xp = xc.data_ptr<float>();
  const isa::WidenProblem pb{xp, ldx, static_cast<const uint8_t*>(qweight.data_ptr()), rows_per_panel * NR,
                             scales.data_ptr<float>(), q4 ? mins->data_ptr<float>() : nullptr,
                             xsum.defined() ? xsum.data_ptr<float>() : nullptr, K, G, group};
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);
  const isa::DequantPanel dequant_panel = kernels.dequant[fmt];
  if (!dequant) {
    const isa::WidenTile* tiles = kernels.tiles[fmt];
    for_each_tile(M, N, K, {kernels.rows, M, MIN_WORK}, b, yp, ldy, no_panel_setup,
                  [&](int64_t p, int64_t m, int rows, float* tmp) { tiles[rows - 1](pb, p, m, tmp); });
  } else if (!packed_x) {
    // Row blocks whose x rows fit in about half of L2 stay there across a thread's panels; each block
    // dequantizes the panels again.
    const int64_t row_block = std::max<int64_t>(64, (256 * 1024) / (4 * K)) / 8 * 8;
    for_each_tile(
        M, N, K, {isa::kMaxWidenRows, row_block, MIN_WORK}, b, yp, ldy,
        [&](int64_t p) {
          t_panel.resize(static_cast<size_t>(K * NR));
          dequant_panel(pb, p, t_panel.data());
        },
        [&](int64_t, int64_t m, int rows, float* tmp) {
          kernels.f32[rows - 1](xp + m * ldx, ldx, t_panel.data(), K, tmp);
        });
  } else {  // x in the fp32 kernel's k-major row tiles, once for all threads
    const int64_t tiles = (M + PACKED_MR - 1) / PACKED_MR;
    xt = torch::empty({tiles * PACKED_MR * K}, x.options());
    float* xtp = xt.data_ptr<float>();
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      const int64_t m0 = t0 * PACKED_MR, m1 = std::min(M, t1 * PACKED_MR);
      pack_x_tiles(xp + m0 * ldx, ldx, m1 - m0, K, xtp + m0 * K);
    });
    const int64_t grain = std::max<int64_t>(1, MIN_WORK / std::max<int64_t>(1, M * K * NR));
    at::parallel_for(0, (N + NR - 1) / NR, grain, [&](int64_t p0, int64_t p1) {
      many_rows_packed(dequant_panel, pb, xtp, M, N, b, yp, ldy, p0, p1);
    });
  }
  return y;
}

}  // namespace

torch::Tensor q8_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      int64_t group, int64_t out_features, const std::optional<torch::Tensor>& bias,
                      const std::optional<torch::Tensor>& out, int64_t isa_code) {
  return quant_gemm(isa::kQ8, x, qweight, scales, std::nullopt, group, out_features, bias, out, isa_code);
}

torch::Tensor q4_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      const torch::Tensor& mins, int64_t group, int64_t out_features,
                      const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                      int64_t isa_code) {
  return quant_gemm(isa::kQ4, x, qweight, scales, mins, group, out_features, bias, out, isa_code);
}

torch::Tensor f8_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      int64_t group, int64_t out_features, const std::optional<torch::Tensor>& bias,
                      const std::optional<torch::Tensor>& out, int64_t isa_code) {
  return quant_gemm(isa::kF8, x, qweight, scales, std::nullopt, group, out_features, bias, out, isa_code);
}

std::vector<int64_t> supported_isas() {
  std::vector<int64_t> isas{ISA_GENERIC};
  if (cpu_has_avx2()) isas.push_back(ISA_AVX2);
  if (cpu_has_avx512()) isas.push_back(ISA_AVX512);
  return isas;
}
