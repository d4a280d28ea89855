"""Quantized weights by rows, the layout of the Triton weight-only kernel (``kernels/triton_quant_matmul.py``):
one class per format (``Int8Rows``, ``Q4Rows``, ``Fp8Rows``), each binding the kernel launch with its kind.

``QPanels`` (``qpanels.py``) is the CPU kernels' panel layout; ``layouts.layout_for`` hands the quantization
methods this family where the platform packs by rows (CUDA), so a method packs the same way on either device.
Where Triton does not run for the weight's tensors it falls back to dequantize-then-matmul, as ``QPanels``
does where its kernels cannot run.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from pagedllm.kernels import triton_quant_matmul as tqm
from pagedllm.model_executor.layers.quantization.base import CpuMatmul
from pagedllm.model_executor.layers.quantization.packed_weight import PackedWeight
from pagedllm.platforms import platform_of


def _group(k: int, scales: torch.Tensor) -> int:
    """The group size; the kernel's K tiles must each lie in one group: a ValueError at load time, not a failed
    launch."""
    group = k // scales.shape[1]
    tqm.block_k_for(group, k)
    return group


class QRows(PackedWeight):
    """A quantized weight [N, K] by rows; ``scales`` / ``mins`` float32 [N, K/group]."""

    layout = "rows"
    #: The kernel's ``kind`` argument (``tqm.KIND_*``).
    kind: ClassVar[int]

    @classmethod
    def pack_q8(cls, q: torch.Tensor, scales: torch.Tensor) -> Int8Rows:
        """q int8 [N, K], scales float [N, K / group]."""
        return Int8Rows.pack(q, scales)

    @classmethod
    def pack_w8a8(cls, q: torch.Tensor, scales: torch.Tensor) -> Int8Rows:
        """W8A8 is a CPU (VNNI) path: here int8 weights are weight-only."""
        return Int8Rows.pack(q, scales)

    @classmethod
    def pack_q4(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Q4Rows:
        """q uint8 values 0..15 [N, K], scales / mins float [N, K / group]."""
        return Q4Rows.pack(q, scales, mins)

    @classmethod
    def pack_f8(cls, q: torch.Tensor, scales: torch.Tensor) -> Fp8Rows:
        """q float8_e4m3fn (or its uint8 bytes) [N, K], scales float [N, K / group]."""
        return Fp8Rows.pack(q, scales)

    def bind(self, isa: int | None = None) -> CpuMatmul | None:
        if not platform_of(self.qweight).runs_triton():
            return None
        launch, qw, s, mins, kind = tqm.weight_only_matmul, self.qweight, self.scales, self.mins, self.kind
        g, n = self.group, self.out_features
        return lambda x, bias, out: launch(x, qw, s, mins, g, n, kind, bias, out)

    def _levels(self) -> torch.Tensor:
        """The quantized levels as float32 [N, K]."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        w = self._levels() * self.scales.repeat_interleave(self.group, dim=1)[:, :self.in_features]
        if self.mins is not None:
            w += self.mins.repeat_interleave(self.group, dim=1)[:, :self.in_features]
        return w


class Int8Rows(QRows):
    """``qweight`` int8 [N, K]: w = scale * q."""

    kind = tqm.KIND_Q8

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor) -> Int8Rows:
        n, k = q.shape
        group = _group(k, scales)
        return cls(q.to(torch.int8).contiguous(), scales.float().contiguous(), None, group, n, k)

    def _levels(self) -> torch.Tensor:
        return self.qweight.float()


class Q4Rows(QRows):
    """``qweight`` uint8 [N, ceil(K/2)], even k in the low nibble: w = scale * q + min."""

    kind = tqm.KIND_Q4
    is_q4 = True

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Q4Rows:
        n, k = q.shape
        group = _group(k, scales)
        q = q.to(torch.uint8)
        if k % 2:
            q = F.pad(q, (0, 1))
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        return cls(packed, scales.float().contiguous(), mins.float().contiguous(), group, n, k)

    def _levels(self) -> torch.Tensor:
        return torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1).flatten(1)[:, :self.in_features].float()


class Fp8Rows(QRows):
    """``qweight`` uint8 [N, K] (float8 e4m3fn bit patterns): w = scale * q."""

    kind = tqm.KIND_F8

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor) -> Fp8Rows:
        n, k = q.shape
        group = _group(k, scales)
        return cls(q.view(torch.uint8).contiguous(), scales.float().contiguous(), None, group, n, k)

    def _levels(self) -> torch.Tensor:
        return self.qweight.view(torch.float8_e4m3fn).float()
