"""Unquantized linear layers: the weight as loaded, then bound to the float form its platform runs fastest.

``bind_float_weight`` is the one place that asks the platform: float32 on a CPU with the C++ kernels ->
``Float32Panels`` (``float_weights.py``: packed once, where BLAS repacks per call); bfloat16 on a CPU with native
bf16 -> ``Bf16Weight`` (``bf16_weights.py``: oneDNN's prepacked layout, bf16 panels where the autotuner
chooses them); elsewhere (GPU, float16, no compiler) ``PlainWeight``, ``F.linear`` on the layer's parameter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers.quantization.base import (
    LinearMethod,
    load_rows,
    set_weight_loader,
)
from pagedllm.model_executor.layers.quantization.bf16_weights import Bf16Weight
from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight
from pagedllm.model_executor.layers.quantization.float_weights import Float32Panels, PlainWeight
from pagedllm.model_executor.layers.quantization.float_weights import pack_bf16_weight as pack_bf16_weight
from pagedllm.model_executor.layers.quantization.float_weights import pack_weight as pack_weight
from pagedllm.platforms import platform_of


def bind_float_weight(weight: torch.Tensor) -> BoundWeight:
    """The loaded float weight [N, K] in the form its platform runs: what the platform has is asked here only."""
    platform = platform_of(weight)
    if weight.dtype == torch.bfloat16 and platform.onednn_bf16():
        kernels = platform.cpu_kernels(weight.dtype, (torch.bfloat16,))
        panels = (kernels is not None and hasattr(kernels, "bf16_gemm") and kernels.bf16_gemm_supported()
                  and weight.shape[1] % 2 == 0)
        return Bf16Weight.pack(weight, kernels if panels else None)
    kernels = platform.cpu_kernels(weight.dtype)
    if kernels is None:
        return PlainWeight(weight)
    return Float32Panels.pack(weight, kernels)


class UnquantizedLinearMethod(LinearMethod):
    """``weight`` [N, K] in the model dtype; after loading, ``layer.float_weight``: the ``BoundWeight`` of
    ``bind_float_weight``, which replaces the parameter unless it is the plain form."""

    name = "unquantized"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False)
        if not weight.is_meta:  # a layer built outside load_model (tests) starts like nn.Linear
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        layer.weight = set_weight_loader(weight, lambda p, w, shard_id=None: load_rows(layer, p, w, shard_id))
        layer.float_weight = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.float_weight is not None:
            return
        layer.float_weight = bind_float_weight(layer.weight)
        if not layer.float_weight.in_layer_parameters:
            layer.weight = None  # the packed copy replaces it

    def bound_weight(self, layer: nn.Module) -> BoundWeight | None:
        return layer.float_weight

    def set_bound_weight(self, layer: nn.Module, weight: BoundWeight) -> None:
        layer.float_weight = weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None) -> torch.Tensor:
        if layer.float_weight is None:  # not loaded yet (a layer built in a test): the parameter as initialised
            return F.linear(x, layer.weight, bias)
        return layer.float_weight.matmul(x, bias, out)

    def bias_dtype(self, dtype: torch.dtype) -> torch.dtype:
        # The model dtype, as nn.Linear: F.linear takes the bias in the activations' dtype (also for a layer a
        # quantized checkpoint keeps in float, its head or an ignored layer, in bf16 on CUDA).
        return dtype

    def scheme(self, layer: nn.Module) -> str:
        if layer.float_weight is None:
            return f"{self.name} {str(layer.weight.dtype).removeprefix('torch.')}"
        return f"{self.name} {layer.float_weight.describe()}"
