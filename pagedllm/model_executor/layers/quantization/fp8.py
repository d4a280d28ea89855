"""fp8 weights: float8 e4m3fn values with float scales, activations stay float32 (weight-only, like vLLM's
fp8 on hardware without fp8 matmuls).

- ``--quantization fp8``: any float checkpoint is quantized at load, one scale per output channel (the row's
  largest magnitude maps to 448), each shard as it arrives; the LM head becomes int8 per channel.
- Checkpoints whose config.json has ``quantization_config.quant_method == "fp8"``: ``weight`` float8_e4m3fn
  [N, K] with ``weight_scale`` per tensor (a scalar, AutoFP8 / llm-compressor) or per output channel
  ([N, 1] or [N]), or with ``weight_block_size: [bn, bk]`` and ``weight_scale_inv`` [ceil(N / bn), K / bk]
  (transformers' fine-grained fp8); w = scale * fp8. ``input_scale`` (static activation scales) is read and
  ignored: activations are not quantized. Layers in ``ignored_layers`` / ``modules_to_not_convert`` and the
  LM head load as float.
The bytes go unchanged into fp8 panels (``qpanels.py``; rows for Triton, ``qrows.py``); the scales become
per-(row, group) floats.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.logger import init_logger
from pagedllm.model_executor.layers.quantization.base import (
    LinearMethod,
    PackedLinearMethod,
    QuantizationConfig,
    check_shape,
    set_weight_loader,
    shard_range,
)
from pagedllm.model_executor.layers.quantization.layouts import layout_for
from pagedllm.model_executor.layers.quantization.qpanels import quantize_f8
from pagedllm.model_executor.layers.quantization.registry import register_quantization_config
from pagedllm.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from pagedllm.model_executor.layers.quantization.weight_only import WeightOnlyLinearMethod

logger = init_logger(__name__)


class Fp8LinearMethod(PackedLinearMethod):
    """``weight`` holds the fp8 bytes [N, K] until packing, ``f8_scales`` [N, K / group] float32.

    ``checkpoint_scales``: the checkpoint brings fp8 weights and their scales (``weight_scale``, or
    ``weight_scale_inv`` with ``block``); float weights (a tied head, a float shard) are quantized here.
    """

    def __init__(self, checkpoint_scales: bool = False, block: tuple[int, int] | None = None,
                 static_input_scale: bool = False) -> None:
        self.checkpoint_scales = checkpoint_scales
        self.block = block
        self.static_input_scale = static_input_scale
        self.name = "fp8 " + (f"block {block[0]}x{block[1]}" if block else "per-channel")

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        n, k = layer.out_features, layer.in_features
        group = self.block[1] if self.block else k
        if k % group:
            raise ValueError(f"quantization fp8: {layer.prefix or 'a linear layer'} has {k} inputs, not a multiple "
                             f"of the block size {group}")
        layer.quant_group = group
        weight = nn.Parameter(torch.empty(n, k, dtype=torch.uint8), requires_grad=False)
        layer.weight = set_weight_loader(weight, lambda p, w, shard_id=None: self._load_weight(layer, w, shard_id))
        layer.register_buffer("f8_scales", torch.zeros(n, k // group), persistent=False)
        layer.f8_ckpt_scales = {}  # shard -> the checkpoint's scale tensor, applied after loading
        layer.f8_raw_shards = set()  # shards whose fp8 bytes wait for a checkpoint scale
        layer.qpanels = None
        if self.checkpoint_scales:
            name = "weight_scale_inv" if self.block else "weight_scale"
            scale = nn.Parameter(torch.empty(0), requires_grad=False)
            setattr(layer, name, set_weight_loader(
                scale, lambda p, w, shard_id=None: layer.f8_ckpt_scales.__setitem__(shard_id or 0, w.float())))
            if self.static_input_scale:
                ignored = nn.Parameter(torch.empty(0), requires_grad=False)
                layer.input_scale = set_weight_loader(ignored, lambda p, w, shard_id=None: None)

    def _load_weight(self, layer: nn.Module, loaded: torch.Tensor, shard_id: int | None) -> None:
        start, rows = shard_range(layer, shard_id)
        check_shape(f"{layer.prefix or 'linear'}" + ("" if shard_id is None else f" (shard {shard_id})"),
                    tuple(loaded.shape), (rows, layer.in_features))
        if loaded.dtype == torch.float8_e4m3fn:
            if not self.checkpoint_scales:
                raise ValueError(f"{layer.prefix or 'linear'}: float8 weights need their checkpoint's scales "
                                 "(config.json quantization_config with quant_method fp8)")
            layer.weight.data[start:start + rows] = loaded.view(torch.uint8)
            layer.f8_raw_shards.add(shard_id or 0)
            return
        q, scales = quantize_f8(loaded, layer.quant_group)
        layer.weight.data[start:start + rows] = q.view(torch.uint8)
        layer.f8_scales[start:start + rows] = scales

    def load_input_slice(self, layer: nn.Module, loaded: torch.Tensor, part: Any, shard_id: int | None) -> bool:
        """Row-parallel (tensor parallelism): float rows quantized per channel with the whole row's scale, then cut
        to input columns ``part`` (block scales and fp8 checkpoints slice as they are: False)."""
        if self.block is not None or loaded.dtype == torch.float8_e4m3fn:
            return False
        start, rows = shard_range(layer, shard_id)
        q, scales = quantize_f8(loaded, loaded.shape[1])
        layer.weight.data[start:start + rows] = q.view(torch.uint8)[:, part.start:part.start + part.size]
        layer.f8_scales[start:start + rows] = scales
        return True

    def _shard_scales(self, layer: nn.Module, shard: int, rows: int) -> torch.Tensor:
        """The checkpoint scale of one shard as [rows, K / group]."""
        s = layer.f8_ckpt_scales.get(shard)
        if s is None:
            raise ValueError(f"{layer.prefix or 'linear'}: shard {shard} has float8 weights but no "
                             f"{'weight_scale_inv' if self.block else 'weight_scale'} in the checkpoint")
        g = layer.in_features // layer.quant_group
        if self.block:
            bn = self.block[0]
            expected = (-(-rows // bn), g)
            check_shape(f"{layer.prefix or 'linear'} weight_scale_inv (shard {shard})", tuple(s.shape), expected)
            return s.repeat_interleave(bn, dim=0)[:rows]
        if s.numel() == 1:  # per tensor
            return s.reshape(1, 1).expand(rows, g)
        check_shape(f"{layer.prefix or 'linear'} weight_scale (shard {shard})", (s.numel(),), (rows,))
        return s.reshape(rows, 1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.qpanels is not None:
            return
        for shard in sorted(layer.f8_raw_shards):
            start, rows = shard_range(layer, shard)
            layer.f8_scales[start:start + rows] = self._shard_scales(layer, shard, rows)
        layer.qpanels = layout_for(layer.weight).pack_f8(layer.weight.data, layer.f8_scales)
        layer.weight = None  # the panels replace the rows
        layer.f8_scales = None
        layer.f8_ckpt_scales = {}
        for name in ("weight_scale", "weight_scale_inv", "input_scale"):
            if hasattr(layer, name):
                setattr(layer, name, None)


@register_quantization_config("fp8")
class Fp8Config(QuantizationConfig):
    """``--quantization fp8`` (no arguments) or an fp8 checkpoint's ``quantization_config`` (``from_hf``)."""

    name = "fp8"
    reads_checkpoints = True

    def __init__(self, checkpoint: bool = False, block: tuple[int, int] | None = None,
                 static_input_scale: bool = False, ignored: tuple[str, ...] = ()) -> None:
        self.checkpoint = checkpoint
        self.block = block
        self.static_input_scale = static_input_scale
        self.ignored = ignored

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Fp8Config:
        fmt = str(cfg.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"quantization fp8: float8 format {fmt!r} is not supported (only e4m3)")
        block = cfg.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(int(b) for b in block) < 1):
            raise ValueError(f"quantization fp8: weight_block_size must be [rows, columns], got {block}")
        scheme = str(cfg.get("activation_scheme", "dynamic")).lower()
        if scheme == "static":
            logger.info("fp8 checkpoint with static activation scales: weights stay fp8, activations float32 "
                        "(input_scale is not used)")
        ignored = tuple(cfg.get("ignored_layers") or ()) + tuple(cfg.get("modules_to_not_convert") or ())
        return cls(True, (int(block[0]), int(block[1])) if block else None, scheme == "static", ignored)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        if self.checkpoint and (prefix.endswith("lm_head") or _matches(prefix, self.ignored)):
            return UnquantizedLinearMethod()  # stored as float in fp8 checkpoints
        if prefix.endswith("lm_head"):
            # Logits are the most sensitive to weight error: an fp8 head alone cost +3% perplexity on the
            # default model, an int8 per-channel one +0.3% (as with int4).
            return WeightOnlyLinearMethod(8, None)
        return Fp8LinearMethod(self.checkpoint, self.block, self.static_input_scale)


_SHARD_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _matches(prefix: str, names: tuple[str, ...]) -> bool:
    """Whether layer ``prefix`` is in an ignore list: by its own name or, for a fused layer, a shard's
    checkpoint name (``...self_attn.q_proj`` for ``...self_attn.qkv_proj``)."""
    parent, _, leaf = prefix.rpartition(".")
    candidates = {prefix, *(f"{parent}.{shard}" if parent else shard for shard in _SHARD_NAMES.get(leaf, ()))}
    return any(n in candidates for n in names)
