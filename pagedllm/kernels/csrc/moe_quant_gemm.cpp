// The quantized experts of a mixture-of-experts layer in one call: y[R, N], x's rows sorted by expert, the rows
// [ends[e-1], ends[e]) multiplied by expert e's weight only. The experts' weights are the dense layers' quantized
// panels (qpanels.py) stacked along a first dimension [E, ...], and each item (expert, rows, range of panels: as
// moe_gemm.cpp) runs the same ISA tiles as that format's dense matmul:
//   layout 0  int8 [E, P, K, 16], float32 scales              (widening q8 tiles: --quantization int8, GGUF Q8_0)
//   layout 1  uint8 nibble pairs [E, P, K/2, 16], float32 scales and mins   (widening q4 tiles: "pairs")
//   layout 2  float8 e4m3 bytes [E, P, K, 16], float32 scales  (widening fp8 tiles)
//   layout 3  dot8 blocks [E, P, K/8, 64], float16 scales and mins          (4-bit byte dot products: int4, GGUF Q4)
//   layout 4  dot4 blocks [E, P, K/4, 64], float16 or float32 scales        (8-bit byte dot products)
// Scales (and mins) are [E, P, K/group, 16]. Widening tiles read each item's rows directly up to 8 rows; from 9 on
// (a prefill's runs) each panel is dequantized once per item and multiplied by the ISA's fp32 tiles where it has
// them, as quant_gemm.cpp does. The byte-dot layouts split all R rows of x into their two int8 terms once.
//
// Why: the quantized experts were per-expert Linear layers called from Python for each expert with rows, ~20 torch
// calls per layer and step, which a CPU step graph cannot record; here the whole MoE layer is kernel calls.
#include "moe_gemm.h"

#include "cpu_features.h"
#include "dot_gemm.h"
#include "gemm_args.h"
#include "isa_kernels.h"
#include "moe_items.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t NR = isa::NR;
constexpr int64_t MIN_ITEM_WORK = int64_t{1} << 16;  // widening makes a panel dearer than fp32's
constexpr int64_t DEQUANT_MIN_ROWS = 9;              // as quant_gemm.cpp
enum Layout { kQ8 = 0, kQ4Pairs = 1, kF8 = 2, kDot8 = 3, kDot4 = 4 };

struct Stacked {
  const uint8_t* w;
  int64_t expert_bytes, panel_bytes;
  const void* scales;
  const void* mins;
  int64_t expert_groups;  // P * G * 16 scales per expert
  bool half;
};

void copy_tile(const float* tmp, int rows, int64_t n0, int64_t N, float* y, int64_t ldy) {
  const int64_t cols = std::min(NR, N - n0);
  for (int i = 0; i < rows; ++i) std::copy(tmp + i * NR, tmp + i * NR + cols, y + i * ldy + n0);
}

// One item of a widening layout: rows [row0, row0 + rows) x panels [p0, p1) of the expert.
void widen_item(const moe_items::Item& it, isa::Format fmt, const isa::WidenKernels& k, const Stacked& st,
                const float* x, int64_t ldx, const float* xsum, int64_t K, int64_t G, int64_t group, int64_t N, float* y,
                int64_t ldy) {
  const auto* scales = static_cast<const float*>(st.scales) + it.expert * st.expert_groups;
  const auto* mins = st.mins ? static_cast<const float*>(st.mins) + it.expert * st.expert_groups : nullptr;
  const isa::WidenProblem pb{x, ldx, st.w + it.expert * st.expert_bytes, st.panel_bytes, scales, mins, xsum, K, G,
                             group};
  float tmp[isa::kMaxWidenRows * NR];
  const bool dequant = it.rows >= DEQUANT_MIN_ROWS && k.f32[0] != nullptr;
  thread_local std::vector<float> panel;
  if (dequant) panel.resize(static_cast<size_t>(K * NR));
  const int step = dequant ? isa::kMaxWidenRows : k.rows;
  for (int64_t p = it.p0; p < it.p1; ++p) {
    if (dequant) k.dequant[fmt](pb, p, panel.data());
    for (int64_t m = it.row0; m < it.row0 + it.rows; m += step) {
      const int rows = static_cast<int>(std::min<int64_t>(step, it.row0 + it.rows - m));
      if (dequant) k.f32[rows - 1](x + m * ldx, ldx, panel.data(), K, tmp);
      else k.tiles[fmt][rows - 1](pb, p, m, tmp);
      copy_tile(tmp, rows, p * NR, N, y + m * ldy, ldy);
    }
  }
}

// One item of a byte-dot layout, x given as its two int8 terms.
void dot_item(const moe_items::Item& it, const isa::DotTile* tiles, const Stacked& st, const dot_gemm::Activations& a,
              int64_t K, int64_t group, int64_t N, float* y, int64_t ldy) {
  const void* scales = st.half ? static_cast<const void*>(static_cast<const uint16_t*>(st.scales) + it.expert * st.expert_groups)
                               : static_cast<const void*>(static_cast<const float*>(st.scales) + it.expert * st.expert_groups);
  const auto* mins = st.mins ? static_cast<const uint16_t*>(st.mins) + it.expert * st.expert_groups : nullptr;
  const isa::DotProblem pb = dot_gemm::dot_problem(a, st.w + it.expert * st.expert_bytes, st.panel_bytes, scales,
                                                   st.half, mins, K, group);
  float tmp[isa::kDotRows * NR];
  for (int64_t p = it.p0; p < it.p1; ++p) {
    for (int64_t m = it.row0; m < it.row0 + it.rows; m += isa::kDotRows) {
      const int rows = static_cast<int>(std::min<int64_t>(isa::kDotRows, it.row0 + it.rows - m));
      tiles[rows - 1](pb, p, m, tmp);
      copy_tile(tmp, rows, p * NR, N, y + m * ldy, ldy);
    }
  }
}

}  // namespace

torch::Tensor moe_quant_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                             const std::optional<torch::Tensor>& mins, int64_t layout, int64_t group,
                             int64_t out_features, const torch::Tensor& ends, const std::optional<torch::Tensor>& out,
                             int64_t isa_code) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be float32 [R, K]");
  TORCH_CHECK(layout >= kQ8 && layout <= kDot4, "layout must be 0..4, got ", layout);
  const int64_t R = x.size(0), K = x.size(1), N = out_features, P = (N + NR - 1) / NR;
  TORCH_CHECK(K > 0 && N > 0 && group > 0 && K % group == 0, "group ", group, " must divide K = ", K);
  const bool dot = layout == kDot8 || layout == kDot4, nibbles = layout == kQ4Pairs || layout == kDot8;
  // per panel: (rows of the panel, bytes per row) in the layout's own terms
  const int64_t panel_rows = layout == kDot8 ? K / 8 : layout == kDot4 ? K / 4 : layout == kQ4Pairs ? K / 2 : K;
  const int64_t row_bytes = dot ? 64 : NR;
  TORCH_CHECK(!dot || group % (layout == kDot8 ? 8 : 4) == 0, "group ", group, " does not fit the byte-dot blocks");
  TORCH_CHECK(layout != kQ4Pairs || group % 2 == 0, "group ", group, " must be even for 4-bit pairs");
  const auto qtype = layout == kQ8 ? torch::kInt8 : torch::kUInt8;
  TORCH_CHECK(qweight.is_contiguous() && qweight.dim() == 4 && qweight.size(1) == P && qweight.size(2) == panel_rows &&
              qweight.size(3) == row_bytes && qweight.scalar_type() == qtype,
              "qweight must be contiguous [E, ", P, ", ", panel_rows, ", ", row_bytes, "] for layout ", layout,
              "; got ", qweight.sizes());
  const int64_t E = qweight.size(0), G = K / group;
  const bool half = scales.scalar_type() == torch::kHalf;
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == E * P * G * NR &&
              (half ? (dot) : scales.scalar_type() == torch::kFloat32),
              "scales must be contiguous [E, P, K/group, 16], float16 only for the byte-dot layouts");
  TORCH_CHECK(layout != kDot8 || half, "the dot8 layout keeps float16 scales");
  if (nibbles) {
    TORCH_CHECK(mins.has_value() && mins->is_contiguous() && mins->numel() == E * P * G * NR &&
                mins->scalar_type() == scales.scalar_type(), "4-bit layouts need mins like their scales");
  }
  TORCH_CHECK(ends.size(0) == E, "ends has ", ends.size(0), " experts, the weights ", E);
  const std::vector<moe_items::Item> items = moe_items::expert_items(ends, R, P, K, MIN_ITEM_WORK);
  const torch::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  torch::Tensor y = gemm_output(out, R, N, x.options());
  if (R == 0) return y;
  const Stacked st{static_cast<const uint8_t*>(qweight.data_ptr()), P * panel_rows * row_bytes, panel_rows * row_bytes,
                   scales.data_ptr(), nibbles ? mins->data_ptr() : nullptr, P * G * NR, half};
  const isa::Kernels& kernels = isa::kernels_for(isa_code);
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = xc.stride(0), ldy = y.stride(0), n_items = static_cast<int64_t>(items.size());
  if (dot) {
    const isa::Kernels* k = &kernels;
    const isa::DotTile* tiles = layout == kDot8 ? k->dot->q4 : half ? k->dot->q8_half : k->dot->q8_float;
    if (layout == kDot8 && group <= 32) tiles = k->dot->q4_short;
    if (tiles[0] == nullptr) {  // 8-bit byte products need VNNI: the portable tiles elsewhere (same results)
      k = &isa::kernels_for(ISA_GENERIC);
      tiles = half ? k->dot->q8_half : k->dot->q8_float;
    }
    dot_gemm::Activations act;
    dot_gemm::quantize_activations(xp, ldx, R, K, group, act, k->dot->split_group);
    at::parallel_for(0, n_items, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) dot_item(items[i], tiles, st, act, K, group, N, yp, ldy);
    });
    return y;
  }
  const isa::Format fmt = layout == kQ8 ? isa::kQ8 : layout == kQ4Pairs ? isa::kQ4 : isa::kF8;
  torch::Tensor xsum;
  if (nibbles) xsum = xc.narrow(1, 0, K).reshape({R, G, group}).sum(-1).contiguous();
  const float* xs = xsum.defined() ? xsum.data_ptr<float>() : nullptr;
  at::parallel_for(0, n_items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      widen_item(items[i], fmt, *kernels.widen, st, xp, ldx, xs, K, G, group, N, yp, ldy);
  });
  return y;
}
