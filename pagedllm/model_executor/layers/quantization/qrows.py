"""Quantized weights on CUDA: the row layout of the Triton weight-only kernel (``kernels/triton_quant_matmul.py``).

``QPanels`` (``qpanels.py``) is the CPU kernels' panel layout; its ``pack_*`` constructors hand tensors that
live on a CUDA device to ``QRows`` instead, so a quantization method packs the same way on either device.
``QRows`` offers the same interface (``matmul``, ``dequantize``, ``nbytes``, ``is_q4``...). Without triton it
falls back to dequantize-then-matmul, as ``QPanels`` does where its kernels cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.kernels import triton_quant_matmul as tqm
from pagedllm.platforms import platform_of


def _check_group(k: int, scales: torch.Tensor) -> None:
    """The kernel's K tiles must each lie in one group: a ValueError at load time, not a failed launch."""
    tqm.block_k_for(k // scales.shape[1], k)


@dataclass
class QRows:
    """A quantized weight [N, K] by rows: ``qweight`` int8 [N, K] (q8), uint8 [N, ceil(K/2)] (q4, even k in the
    low nibble) or uint8 [N, K] (f8: float8 e4m3fn bit patterns); ``scales`` / ``mins`` float32 [N, K/group]
    (``mins`` only for q4)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int
    out_features: int
    in_features: int
    is_fp8: bool = False
    layout: str = "rows"
    #: W8A8 is a CPU (VNNI) path; on CUDA int8 weights are weight-only.
    dynamic_int8_activations: bool = False

    @classmethod
    def pack_q8(cls, q: torch.Tensor, scales: torch.Tensor) -> QRows:
        n, k = q.shape
        _check_group(k, scales)
        return cls(q.to(torch.int8).contiguous(), scales.float().contiguous(), None, k // scales.shape[1], n, k)

    @classmethod
    def pack_q4(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> QRows:
        n, k = q.shape
        _check_group(k, scales)
        q = q.to(torch.uint8)
        if k % 2:
            q = F.pad(q, (0, 1))
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        return cls(packed, scales.float().contiguous(), mins.float().contiguous(), k // scales.shape[1], n, k)

    @classmethod
    def pack_f8(cls, q: torch.Tensor, scales: torch.Tensor) -> QRows:
        n, k = q.shape
        _check_group(k, scales)
        return cls(q.view(torch.uint8).contiguous(), scales.float().contiguous(), None, k // scales.shape[1], n, k,
                   is_fp8=True)

    @property
    def is_q4(self) -> bool:
        return self.mins is not None

    @property
    def kind(self) -> int:
        return tqm.KIND_Q4 if self.is_q4 else tqm.KIND_F8 if self.is_fp8 else tqm.KIND_Q8

    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (reference and fallback path)."""
        if self.is_q4:
            q = torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1).flatten(1)[:, :self.in_features].float()
        elif self.is_fp8:
            q = self.qweight.view(torch.float8_e4m3fn).float()
        else:
            q = self.qweight.float()
        w = q * self.scales.repeat_interleave(self.group, dim=1)[:, :self.in_features]
        if self.mins is not None:
            w += self.mins.repeat_interleave(self.group, dim=1)[:, :self.in_features]
        return w

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
               isa: int | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] (+ bias) in x's dtype; ``isa`` is the CPU kernels' argument, unused here."""
        if platform_of(x).runs_triton():
            return tqm.weight_only_matmul(x, self.qweight, self.scales, self.mins, self.group, self.out_features,
                                          self.kind, bias, out)
        y = F.linear(x, self.dequantize().to(x.dtype), None if bias is None else bias.to(x.dtype))
        return out.copy_(y) if out is not None else y

    def cpu_matmul(self) -> None:
        """No C++ CPU kernel reads this layout."""
        return None
