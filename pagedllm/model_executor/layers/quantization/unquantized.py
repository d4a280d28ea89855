"""Plain float weights, and the packed layout the CPU fp32 matmul kernel reads.

On a CPU with the C++ kernels (float32 weights), the weight is repacked after loading into panels of 16
output columns (``kernels/csrc/packed_gemm.cpp``). The packed copy replaces the weight, so memory does not
grow; matmuls then skip BLAS's per-call repacking. Measured on the default model's shapes, 2 cores: 1.1-1.4x
MKL at 200 rows, 1.05-1.15x at 2048, ~2.5x at 1-32 rows. Elsewhere (GPU, bf16, no compiler) the layer stays
plain ``F.linear``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.autotune import bucket_index
from pagedllm.model_executor.layers.quantization.base import (
    CpuMatmul,
    LinearMethod,
    load_rows,
    set_weight_loader,
)
from pagedllm.platforms import platform_of

PANEL = 16  # output columns per panel; must match NR in packed_gemm.cpp / quant_gemm.cpp


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 16), K, 16] panels (zero-padded past N), what ``packed_gemm`` reads."""
    n, k = weight.shape
    padded_n = -(-n // PANEL) * PANEL
    w = F.pad(weight.detach(), (0, 0, 0, padded_n - n))
    return w.view(padded_n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weight [N, K] (K even) -> [ceil(N / 16), K / 2, 16, 2] panels (zero-padded past N), what ``bf16_gemm``
    reads: one 64-byte row per pair of k, the operand of one AVX-512 BF16 dot product."""
    panels = pack_weight(weight)  # [P, K, 16]: the float panels, whose k rows pair up
    p, k, _ = panels.shape
    return panels.view(p, k // 2, 2, PANEL).transpose(2, 3).contiguous()


# Activations oneDNN fuses into the matmul: name -> (post-op, algorithm)
_ONEDNN_ACTIVATIONS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


class UnquantizedLinearMethod(LinearMethod):
    """``weight`` [N, K] in the model dtype, repacked after loading where a kernel applies: float32 into the
    panels of the C++ kernel; bfloat16 on a CPU with native bf16 into oneDNN's blocked layout. The latter
    skips oneDNN's per-call weight reorder (~20% of a BERT matmul) and fuses bias and GELU into the matmul
    (torch's separate bf16 GELU cost more than the matmul it follows). Where the C++ kernels have AVX-512 BF16,
    the plain bf16 weight is kept until the autotuner has timed the C++ bf16 panels (``bf16_gemm``) against
    oneDNN (``kernel_choice.py``), which binds ``_bf16_matmul`` when the panels win a bucket of rows."""

    name = "unquantized"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False)
        if not weight.is_meta:  # a layer built outside load_model (tests) starts like nn.Linear
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        layer.weight = set_weight_loader(weight, lambda p, w, shard_id=None: load_rows(layer, p, w, shard_id))
        layer.packed_weight = None
        layer.onednn_weight = None
        layer._kernels = None
        layer.bf16_panels = None  # [ceil(N/16), K/2, 16, 2] (pack_bf16_weight), when the autotuner chose them
        layer._bf16_matmul = None  # the per-bucket kernel of a bf16 layer (oneDNN and/or panels)
        layer._bf16_panel_buckets = ()  # per bucket of rows: whether it runs the panels
        layer._bf16_plain = None  # the plain bf16 weight, kept for the autotuner until it has decided

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.packed_weight is not None or layer.onednn_weight is not None:
            return
        w = layer.weight
        platform = platform_of(w)
        if w.dtype == torch.bfloat16 and platform.onednn_bf16():
            layer.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            kernels = platform.cpu_kernels(w.dtype, (torch.bfloat16,))
            if kernels is not None and hasattr(kernels, "bf16_gemm") and kernels.bf16_gemm_supported() and \
                    layer.in_features % 2 == 0:
                layer._bf16_plain = w.detach()
                layer._kernels = kernels
            layer.weight = None  # the packed copy replaces it
            return
        kernels = platform.cpu_kernels(w.dtype)
        if kernels is None:
            return
        layer.packed_weight = pack_weight(layer.weight)
        layer._kernels = kernels
        layer.weight = None  # the packed copy replaces it

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None) -> torch.Tensor:
        if layer.packed_weight is not None:
            return layer._kernels.packed_gemm(x, layer.packed_weight, layer.out_features, bias, out)
        bf16_matmul = getattr(layer, "_bf16_matmul", None)  # set by the autotuner (kernel_choice.py)
        if bf16_matmul is not None and x.dtype == torch.bfloat16:
            return bf16_matmul(x, bias, out)
        if layer.onednn_weight is not None:
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.onednn_weight, bias, "none", [], "")
            return out.copy_(y) if out is not None else y
        return F.linear(x, layer.weight, bias)

    def apply_activation(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                         activation: str) -> torch.Tensor | None:
        panels = getattr(layer, "bf16_panels", None)
        if (layer.onednn_weight is None and panels is None) or activation not in _ONEDNN_ACTIVATIONS:
            return None
        if panels is not None and x.dtype == torch.bfloat16 and \
                layer._bf16_panel_buckets[bucket_index(x.shape[0])]:
            y = layer._bf16_matmul(x, bias, None)
            if activation == "relu":
                return y.relu_()
            layer._kernels.gelu_(y, activation == "gelu_tanh")
            return y
        op, algorithm = _ONEDNN_ACTIVATIONS[activation]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.onednn_weight, bias, op, [], algorithm)

    def cpu_matmul(self, layer: nn.Module) -> CpuMatmul | None:
        if layer.packed_weight is None:
            return None
        gemm, packed, n = layer._kernels.packed_gemm, layer.packed_weight, layer.out_features
        return lambda x, bias, out: gemm(x, packed, n, bias, out)

    def packed_nbytes(self, layer: nn.Module) -> int:
        copies = (layer.packed_weight, layer.onednn_weight, getattr(layer, "bf16_panels", None))
        return sum(t.numel() * t.element_size() for t in copies
                   if t is not None)

    def bias_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # The model dtype, as nn.Linear: F.linear takes the bias in the activations' dtype (also for a layer a
        # quantized checkpoint keeps in float, its head or an ignored layer, in bf16 on CUDA).
        return dtype

    def scheme(self, layer: nn.Module) -> str:
        if getattr(layer, "bf16_panels", None) is not None:
            return f"{self.name} bfloat16 (panels{' + oneDNN' if layer.onednn_weight is not None else ''})"
        if layer.onednn_weight is not None:
            return f"{self.name} bfloat16 (oneDNN packed)"
        w = layer.packed_weight if layer.packed_weight is not None else layer.weight
        return f"{self.name} {str(w.dtype).removeprefix('torch.')}"
