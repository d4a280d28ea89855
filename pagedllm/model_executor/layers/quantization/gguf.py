"""``--quantization gguf``: a GGUF file's quantized matrices stay quantized.

Block types map exactly onto the kernels' layouts (``qpanels.py``; rows for Triton, ``qrows.py``):
- Q4_0 / Q4_1 (32 weights: f16 scale, f16 minimum for Q4_1, 16 bytes of nibbles) and Q4_K (256-weight
  super-blocks of eight 32-weight sub-blocks with 6-bit scales and minimums) -> ``q4`` panels, groups of 32
  (Q4_0: min = -8 * scale; Q4_K: scale = d * sc, min = -dmin * m).
- Q8_0 (f16 scale, 32 int8) -> ``q8`` panels, groups of 32; Q6_K (6-bit values with an int8 scale per 16)
  -> ``q8`` groups of 16 (a Q8_0 shard fused with Q6_K ones repeats each scale twice).
A fused layer whose shards mix the two families, and matrices of other types (Q5_K, Q5_0, Q2_K, F16, ...)
are dequantized and re-quantized to int8 in groups of 32 (close to lossless for 6-bit and lower formats).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight
from pagedllm.model_executor.layers.quantization.layouts import layout_for
from pagedllm.model_executor.layers.quantization.qpanels import quantize_q8
from pagedllm.model_executor.layers.quantization.registry import register_quantization_config
from pagedllm.model_executor.layers.quantization.unquantized import bind_float_weight

logger = init_logger(__name__)

# ggml type ids (gguf.GGMLQuantizationType) of the block formats read without dequantizing.
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
Q4_TYPES = frozenset({Q4_0, Q4_1, Q4_K})
Q8_TYPES = frozenset({Q8_0, Q6_K})
_TYPE_NAMES = {0: "F32", 1: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", 6: "Q5_0", 7: "Q5_1", Q8_0: "Q8_0", 10: "Q2_K",
               11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
BLOCK = 32
SUPER_BLOCK = 256  # K-quants


@dataclass
class GGUFQuantTensor:
    """A GGUF matrix as stored: ``raw`` uint8 [rows, row_bytes] of blocks along K, torch ``shape`` (rows, K)."""

    raw: torch.Tensor
    ggml_type: int
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        return _TYPE_NAMES.get(self.ggml_type, str(self.ggml_type))

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, K] via ``gguf.quants.dequantize`` (the reference)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        arr = dequantize(self.raw.numpy(), GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(self.shape)


def _blocks(t: GGUFQuantTensor, block_bytes: int) -> np.ndarray:
    rows, k = t.shape
    return t.raw.numpy().reshape(rows, k // BLOCK, block_bytes)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte ``at`` of every block -> float32 [rows, blocks]."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 values: byte j holds element j (low nibble) and j + 16 (high nibble)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks -> (scales, mins) uint8 [..., 8].

    Sub-blocks 0-3: low 6 bits of bytes 0-3 (scales) and 4-7 (mins). Sub-blocks 4-7: low / high nibble
    of bytes 8-11, with the top 2 bits of bytes 0-3 (scales) and 4-7 (mins) above them.
    """
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales, mins


def _decode_q4_k(t: GGUFQuantTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K: 144-byte super-blocks: f16 d, f16 dmin, 12 bytes of scales, 128 bytes of nibbles (four runs of 32
    bytes, low nibbles = sub-block 2i, high = 2i + 1); w = d * sc * q - dmin * m."""
    rows, k = t.shape
    b = t.raw.numpy().reshape(rows, k // SUPER_BLOCK, 144)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(rows, k // SUPER_BLOCK, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, k)
    scales = (d[..., None] * sc).reshape(rows, -1)
    mins = -(dmin[..., None] * mn).reshape(rows, -1)
    return q, scales, mins


def _decode_q6_k(t: GGUFQuantTensor) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: 210-byte super-blocks: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d.

    Each half of 128 weights: low nibbles of its 64 ql bytes then their high nibbles; 2-bit pair t of qh
    byte l goes to weight 32t + l. q = (low | high << 4) - 32 in -32..31; w = d * scale[e // 16] * q.
    """
    rows, k = t.shape
    b = t.raw.numpy().reshape(rows, k // SUPER_BLOCK, 210)
    ql = b[..., :128].reshape(rows, -1, 2, 1, 64)
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(rows, -1, 2, 128)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3).reshape(rows, -1, 2, 128)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, k)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    scales = (_f16(b, 208)[..., None] * sc).reshape(rows, -1)
    return q, scales


def decode_q4(t: GGUFQuantTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K -> (q uint8 [rows, K] in 0..15, scales [rows, K/32], mins [rows, K/32]),
    w = s * q + m."""
    rows, k = t.shape
    if t.ggml_type == Q4_K:
        q, d, m = _decode_q4_k(t)
    elif t.ggml_type == Q4_0:
        b = _blocks(t, 18)
        d = _f16(b, 0)
        q, m = _nibbles(b[..., 2:]), -8.0 * d
    else:
        b = _blocks(t, 20)
        d, m = _f16(b, 0), _f16(b, 2)
        q = _nibbles(b[..., 4:])
    return (torch.from_numpy(np.ascontiguousarray(q).reshape(rows, k)), torch.from_numpy(d.astype(np.float32)),
            torch.from_numpy(m.astype(np.float32)))


def decode_q8(t: GGUFQuantTensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 / Q6_K -> (q int8 [rows, K], scales [rows, K/group]), w = s * q; ``group`` 32 or 16 (Q6_K: 16)."""
    rows, k = t.shape
    if t.ggml_type == Q6_K:
        assert group == 16, "Q6_K has a scale per 16 weights"
        q, scales = _decode_q6_k(t)
    else:
        b = _blocks(t, 34)
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8)
        scales = np.repeat(_f16(b, 0), BLOCK // group, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(q).reshape(rows, k)), torch.from_numpy(scales)


class GGUFLinearMethod(PackedLinearMethod):
    """Collects a layer's shards as loaded (raw blocks or floats); packs them after loading."""

    name = "gguf"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        if layer.in_features % BLOCK:
            raise ValueError(f"quantization gguf: {layer.prefix or 'a linear layer'} has {layer.in_features} "
                             f"inputs, not a multiple of {BLOCK}")
        # A placeholder parameter: the checkpoint's ``weight`` lands in layer.gguf_shards, not here.
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.weight = set_weight_loader(weight, lambda p, w, shard_id=None: self._load(layer, w, shard_id))
        layer.gguf_shards = {}
        layer.qpanels = None
        layer.gguf_float = None  # a float matrix kept float: its bound float form (unquantized.bind_float_weight)
        layer.gguf_scheme = "gguf"
        layer.gguf_dtype = dtype  # float matrices stay float in this dtype (float32 on the CPU, bf16/fp16 on CUDA)

    def _load(self, layer: nn.Module, loaded: GGUFQuantTensor | torch.Tensor, shard_id: int | None) -> None:
        _, rows = shard_range(layer, shard_id)
        name = f"{layer.prefix or 'linear'}" + ("" if shard_id is None else f" (shard {shard_id})")
        check_shape(name, tuple(loaded.shape), (rows, layer.in_features))
        layer.gguf_shards[shard_id or 0] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.qpanels is not None or layer.gguf_float is not None:
            return
        n_shards = len(layer.shard_sizes)
        shards = [layer.gguf_shards.get(i) for i in range(n_shards)]
        if any(s is None for s in shards):
            raise ValueError(f"{layer.prefix or 'linear'}: not every shard was loaded")
        device = layer.weight.device  # blocks are decoded on the CPU; the packed weight lives with the layer
        layout = layout_for(layer.weight)
        types = {s.ggml_type if isinstance(s, GGUFQuantTensor) else None for s in shards}
        if types == {None} and layer.prefix != "lm_head":
            # F32 / F16 / BF16 matrices stay float (fp32 panels): kept quantized means as stored, never coarser.
            # (The tied head is built from the embedding's dequantized rows: int8 below, as a quantized file's.)
            dtype = getattr(layer, "gguf_dtype", torch.float32)
            layer.weight = nn.Parameter(torch.cat([s.float() for s in shards]).to(device, dtype), requires_grad=False)
            if layer.bias is not None:  # F.linear takes the bias in the activations' dtype
                layer.bias = nn.Parameter(layer.bias.data.to(dtype), requires_grad=False)
            layer.gguf_float = bind_float_weight(layer.weight)
            if not layer.gguf_float.in_layer_parameters:
                layer.weight = None  # the packed copy replaces it
            layer.gguf_scheme = f"gguf float (kept {str(dtype).removeprefix('torch.')})"
            layer.gguf_shards = {}
            return
        if types <= Q4_TYPES and self._k_quant_fits(layer, types):
            parts = [decode_q4(s) for s in shards]
            layer.qpanels = layout.pack_q4(*(torch.cat([p[i] for p in parts]).to(device) for i in range(3)))
            layer.gguf_scheme = "gguf " + "+".join(sorted(_TYPE_NAMES[t] for t in types))
        elif types <= Q8_TYPES and self._k_quant_fits(layer, types):
            group = 16 if Q6_K in types else BLOCK
            parts = [decode_q8(s, group) for s in shards]
            layer.qpanels = layout.pack_q8(torch.cat([p[0] for p in parts]).to(device),
                                           torch.cat([p[1] for p in parts]).to(device))
            layer.gguf_scheme = "gguf " + "+".join(sorted(_TYPE_NAMES[t] for t in types))
        else:
            w = torch.cat([s.dequantize() if isinstance(s, GGUFQuantTensor) else s.float() for s in shards])
            layer.qpanels = layout.pack_q8(*(t.to(device) for t in quantize_q8(w, BLOCK)))
            names = sorted({s.type_name if isinstance(s, GGUFQuantTensor) else "float" for s in shards})
            layer.gguf_scheme = f"gguf {'+'.join(names)} -> int8 g32"
        layer.gguf_shards = {}
        layer.weight = None

    @staticmethod
    def _k_quant_fits(layer: nn.Module, types: set[int | None]) -> bool:
        return not types & {Q4_K, Q6_K} or layer.in_features % SUPER_BLOCK == 0

    # A float matrix kept float is ``layer.gguf_float``; a quantized one ``layer.qpanels``.
    def bound_weight(self, layer: nn.Module) -> BoundWeight | None:
        return layer.gguf_float if layer.gguf_float is not None else layer.qpanels

    def set_bound_weight(self, layer: nn.Module, weight: BoundWeight) -> None:
        if layer.gguf_float is not None:
            layer.gguf_float = weight
        else:
            layer.qpanels = weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None) -> torch.Tensor:
        return self.bound_weight(layer).matmul(x, bias, out)

    def scheme(self, layer: nn.Module) -> str:
        return layer.gguf_scheme


@register_quantization_config("gguf")
class GGUFConfig(QuantizationConfig):
    """Keep a GGUF file's Q4_0 / Q4_1 / Q4_K / Q8_0 / Q6_K matrices quantized (others: int8 in groups of 32)."""

    name = "gguf"

    @classmethod
    def from_flag(cls, method: str, gguf_file: str | None = None) -> GGUFConfig:
        if not gguf_file:
            raise ValueError("quantization 'gguf' needs a .gguf model file")
        return cls()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return GGUFLinearMethod()
