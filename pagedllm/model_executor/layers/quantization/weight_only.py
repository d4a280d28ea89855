"""``int8`` (per output channel) and ``int4`` (per group of 32/64/128 inputs) weight-only quantization of
float checkpoints at load time; activations stay float32.

Each shard is quantized as it is loaded (a row's scale only depends on that row), so a float copy of the
whole model never exists; after loading the rows are packed into the kernel's layout (``qpanels.py`` on the
CPU, ``qrows.py`` for Triton).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.quantization.base import (
    LinearMethod,
    PackedLinearMethod,
    QuantizationConfig,
    check_shape,
    set_weight_loader,
    shard_range,
)
from pagedllm.model_executor.layers.quantization.layouts import layout_for
from pagedllm.model_executor.layers.quantization.qpanels import quantize_q4, quantize_q8
from pagedllm.model_executor.layers.quantization.registry import register_quantization_config


class WeightOnlyLinearMethod(PackedLinearMethod):
    """``weight`` holds the quantized rows [N, K] until packing; ``weight_scale``/``weight_min`` [N, K/group]."""

    def __init__(self, bits: int, group: int | None, dynamic_int8_activations: bool = False) -> None:
        self.bits = bits
        self.group = group  # None: one group per row (per channel)
        self.dynamic_int8_activations = dynamic_int8_activations  # W8A8 (bits 8, per channel only)
        self.name = ("w8a8" if dynamic_int8_activations else f"int{bits}") + (f" g{group}" if group else
                                                                              " per-channel")

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        n, k = layer.out_features, layer.in_features
        group = self.group or k
        if k % group:
            raise ValueError(f"quantization int{self.bits}: {layer.prefix or 'a linear layer'} has {k} inputs, "
                             f"not a multiple of the group size {group}")
        layer.quant_group = group
        qdtype = torch.int8 if self.bits == 8 else torch.uint8
        weight = nn.Parameter(torch.empty(n, k, dtype=qdtype), requires_grad=False)
        layer.weight = set_weight_loader(weight, lambda p, w, shard_id=None: self._load(layer, w, shard_id))
        layer.register_buffer("weight_scale", torch.empty(n, k // group), persistent=False)
        layer.register_buffer("weight_min", torch.empty(n, k // group) if self.bits == 4 else None,
                              persistent=False)
        layer.qpanels = None

    def _load(self, layer: nn.Module, loaded: torch.Tensor, shard_id: int | None) -> None:
        start, rows = shard_range(layer, shard_id)
        check_shape(f"{layer.prefix or 'linear'}" + ("" if shard_id is None else f" (shard {shard_id})"),
                    tuple(loaded.shape), (rows, layer.in_features))
        if self.bits == 8:
            q, scales = quantize_q8(loaded, layer.quant_group)
        else:
            q, scales, mins = quantize_q4(loaded, layer.quant_group)
            layer.weight_min[start:start + rows] = mins
        layer.weight.data[start:start + rows] = q
        layer.weight_scale[start:start + rows] = scales

    def load_input_slice(self, layer: nn.Module, loaded: torch.Tensor, part: Any, shard_id: int | None) -> bool:
        """Row-parallel (tensor parallelism): a per-channel scale belongs to the whole row, so quantize the whole
        [N, K] row first and keep input columns ``part``; grouped scales fall on the slice as they are (False)."""
        if self.group is not None or loaded.dtype == torch.int8:
            return False
        start, rows = shard_range(layer, shard_id)
        q, scales = quantize_q8(loaded, loaded.shape[1])
        layer.weight.data[start:start + rows] = q[:, part.start:part.start + part.size]
        layer.weight_scale[start:start + rows] = scales
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.qpanels is not None:
            return
        layout = layout_for(layer.weight)
        if self.bits == 4:
            layer.qpanels = layout.pack_q4(layer.weight.data, layer.weight_scale, layer.weight_min)
        elif self.dynamic_int8_activations:
            layer.qpanels = layout.pack_w8a8(layer.weight.data, layer.weight_scale)
        else:
            layer.qpanels = layout.pack_q8(layer.weight.data, layer.weight_scale)
        layer.weight = None  # the panels replace the rows
        layer.weight_scale = None
        layer.weight_min = None


@register_quantization_config("int8")
class Int8Config(QuantizationConfig):
    """``--quantization int8``: symmetric int8 weights with one float scale per output channel."""

    name = "int8"

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return WeightOnlyLinearMethod(8, None)


@register_quantization_config("w8a8")
class W8A8Config(QuantizationConfig):
    """``--quantization w8a8``: int8 per-channel weights, and for 16+ rows (prefill, large batches) the
    activations too, quantized per row at run time, multiplied in int32 by AVX-512 VNNI. Without VNNI (or
    for fewer rows) it runs as ``int8``.

    Only layers fed by an RMSNorm (fused qkv, gate/up) quantize their inputs: attention outputs and
    SiLU(gate) * up carry outlier channels that per-row int8 flattens (all layers: +3.9% perplexity on the
    default model); o_proj, down_proj and the LM head stay weight-only."""

    name = "w8a8"
    NORMED_INPUTS = ("qkv_proj", "gate_up_proj")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return WeightOnlyLinearMethod(8, None, dynamic_int8_activations=prefix.endswith(self.NORMED_INPUTS))


@register_quantization_config("int4", "int4-g64", "int4-g128")
class Int4Config(QuantizationConfig):
    """``--quantization int4`` (group 32), ``int4-g64``, ``int4-g128``: asymmetric 4-bit weights with a scale
    and a minimum per group of inputs. The LM head stays int8 (4-bit logits cost the most quality)."""

    def __init__(self, group: int = 32) -> None:
        if group not in (32, 64, 128):
            raise ValueError(f"quantization int4: group size must be 32, 64 or 128, got {group}")
        self.group = group
        self.name = "int4" if group == 32 else f"int4-g{group}"

    @classmethod
    def from_flag(cls, method: str, gguf_file: str | None = None) -> Int4Config:
        return cls(int(method.removeprefix("int4-g")) if "-g" in method else 32)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        if prefix.endswith("lm_head"):
            return WeightOnlyLinearMethod(8, None)
        return WeightOnlyLinearMethod(4, self.group)
