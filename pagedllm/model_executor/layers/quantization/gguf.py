"""``--quantization gguf``: a GGUF file's quantized matrices stay quantized.

Q4_0 and Q4_1 blocks (32 weights: an f16 scale, an f16 minimum for Q4_1, 16 bytes of nibbles) become the
kernel's ``q4`` panels exactly (Q4_0: min = -8 * scale); Q8_0 blocks (f16 scale, 32 int8) become ``q8``
panels with groups of 32, also exactly. A fused layer whose shards mix block types, and matrices of other
types (K-quants, F16, F32), are dequantized and re-quantized to int8 in groups of 32 (close to lossless
for 6-bit and lower formats).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.logger import init_logger
from pagedllm.model_executor.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    check_shape,
    set_weight_loader,
    shard_range,
)
from pagedllm.model_executor.layers.quantization.qpanels import QPanels, quantize_q8

logger = init_logger(__name__)

# ggml type ids (gguf.GGMLQuantizationType) of the block formats read without dequantizing.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
KEPT_TYPES = frozenset({Q4_0, Q4_1, Q8_0})
_TYPE_NAMES = {0: "F32", 1: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", 6: "Q5_0", 7: "Q5_1", Q8_0: "Q8_0", 10: "Q2_K",
               11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
BLOCK = 32


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


def decode_q4(t: GGUFQuantTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 -> (q uint8 [rows, K] in 0..15, scales [rows, K/32], mins [rows, K/32]), w = s * q + m."""
    rows, k = t.shape
    if t.ggml_type == Q4_0:
        b = _blocks(t, 18)
        d = _f16(b, 0)
        q, m = _nibbles(b[..., 2:]), -8.0 * d
    else:
        b = _blocks(t, 20)
        d, m = _f16(b, 0), _f16(b, 2)
        q = _nibbles(b[..., 4:])
    return torch.from_numpy(q.reshape(rows, k)), torch.from_numpy(d), torch.from_numpy(m)


def decode_q8(t: GGUFQuantTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 -> (q int8 [rows, K], scales [rows, K/32]), w = s * q."""
    rows, k = t.shape
    b = _blocks(t, 34)
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8)
    return torch.from_numpy(q.reshape(rows, k)), torch.from_numpy(_f16(b, 0))


class GGUFLinearMethod(LinearMethod):
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
        layer.gguf_scheme = "gguf"

    def _load(self, layer: nn.Module, loaded: GGUFQuantTensor | torch.Tensor, shard_id: int | None) -> None:
        _, rows = shard_range(layer, shard_id)
        name = f"{layer.prefix or 'linear'}" + ("" if shard_id is None else f" (shard {shard_id})")
        check_shape(name, tuple(loaded.shape), (rows, layer.in_features))
        layer.gguf_shards[shard_id or 0] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.qpanels is not None:
            return
        n_shards = len(layer.shard_sizes)
        shards = [layer.gguf_shards.get(i) for i in range(n_shards)]
        if any(s is None for s in shards):
            raise ValueError(f"{layer.prefix or 'linear'}: not every shard was loaded")
        types = {s.ggml_type if isinstance(s, GGUFQuantTensor) else None for s in shards}
        if types <= {Q4_0, Q4_1}:
            parts = [decode_q4(s) for s in shards]
            layer.qpanels = QPanels.pack_q4(*(torch.cat([p[i] for p in parts]) for i in range(3)))
            layer.gguf_scheme = "gguf " + "+".join(sorted(_TYPE_NAMES[t] for t in types))
        elif types == {Q8_0}:
            parts = [decode_q8(s) for s in shards]
            layer.qpanels = QPanels.pack_q8(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
            layer.gguf_scheme = "gguf Q8_0"
        else:
            w = torch.cat([s.dequantize() if isinstance(s, GGUFQuantTensor) else s.float() for s in shards])
            layer.qpanels = QPanels.pack_q8(*quantize_q8(w, BLOCK))
            names = sorted({s.type_name if isinstance(s, GGUFQuantTensor) else "float" for s in shards})
            layer.gguf_scheme = f"gguf {'+'.join(names)} -> int8 g32"
        layer.gguf_shards = {}
        layer.weight = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor | None) -> torch.Tensor:
        return layer.qpanels.matmul(x, bias, out)

    def scheme(self, layer: nn.Module) -> str:
        return layer.gguf_scheme


class GGUFConfig(QuantizationConfig):
    """Keep a GGUF file's Q4_0 / Q4_1 / Q8_0 matrices quantized (others: int8 in groups of 32)."""

    name = "gguf"

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return GGUFLinearMethod()
