"""Quantized weights in the panel layouts of the C++ kernels, and how to multiply by them.

Every scheme (int8, int4, GGUF Q4_0/Q4_1/Q8_0, fp8, ...) ends as one of three formats, each with per-(row,
group) float scales: ``q8`` (w = scale * q, q int8), ``q4`` (w = scale * q + min, q in 0..15) and ``f8``
(w = scale * fp8(q), q the bytes of float8 e4m3fn values). ``QPanels`` holds
one packed weight; ``QPanels.matmul`` runs the C++ kernel or, where it cannot run (no compiler, GPU), a
dequantize-then-matmul fallback.

4-bit weights are stored in one of two layouts: ``dot8`` (``kernels/csrc/q4_dot_gemm.cpp``: x quantized per
group to int8 and multiplied by byte dot products, about twice the speed of widening the weights to float)
wherever the group is a multiple of 8, else ``pairs`` (``quant_gemm.cpp``: float activations).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.kernels.cpu import cpu_isa
from pagedllm.model_executor.layers.quantization.qrows import QRows
from pagedllm.platforms import platform_of

PANEL = 16
FP8_MAX = 448.0  # largest finite float8 e4m3fn
W8A8_MIN_ROWS = 16  # below this the weight-only kernel (weight-bound) is as fast and exact in x


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N / 16), C, 16], zero-padded past N."""
    n, c = t.shape
    padded = -(-n // PANEL) * PANEL
    t = F.pad(t, (0, 0, 0, padded - n))
    return t.view(padded // PANEL, PANEL, c).transpose(1, 2).contiguous()


@dataclass
class QPanels:
    """A packed quantized weight [N, K]: ``qweight`` int8 [P, K, 16] (q8), uint8 [P, K/2, 16] (q4) or uint8
    [P, K, 16] (f8: float8 e4m3fn bit patterns), ``scales`` / ``mins`` [P, K/group, 16] (``mins`` only for q4;
    float16 in the dot8 layout, else float32)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int
    out_features: int
    in_features: int
    #: Quantize activations per row to int8 for W8A8_MIN_ROWS+ rows where the CPU has VNNI (q8, one group).
    dynamic_int8_activations: bool = False
    #: q4 only: "dot8" uint8 [P, K/8, 64] (q4_dot_gemm) or "pairs" uint8 [P, K/2, 16] (q4_gemm).
    layout: str = "pairs"
    #: ``qweight`` holds float8 e4m3fn bytes (uint8 [P, K, 16]).
    is_fp8: bool = False

    @classmethod
    def pack_q8(cls, q: torch.Tensor, scales: torch.Tensor) -> QPanels | QRows:
        """q int8 [N, K], scales float [N, K / group]. (Every ``pack_*``: tensors on a CUDA device are packed
        by rows for the Triton kernel instead, ``qrows.py``.)"""
        if platform_of(q).packs_quantized_by_rows:
            return QRows.pack_q8(q, scales)
        n, k = q.shape
        group = k // scales.shape[1]
        return cls(_panels(q.to(torch.int8)), _panels(scales.float()), None, group, n, k)

    @classmethod
    def pack_q4(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, layout: str | None = None
                ) -> QPanels | QRows:
        """q uint8 values 0..15 [N, K] (K even), scales / mins float [N, K / group].

        ``layout``: "dot8" or "pairs" (module docstring); default dot8 where the group is a multiple of 8
        (``PAGEDLLM_Q4_LAYOUT=pairs`` picks the old layout, for comparisons).
        """
        if platform_of(q).packs_quantized_by_rows:
            return QRows.pack_q4(q, scales, mins)
        n, k = q.shape
        group = k // scales.shape[1]
        if layout is None:
            layout = envs.PAGEDLLM_Q4_LAYOUT if group % 8 == 0 else "pairs"
        if layout == "dot8" and group % 8:
            raise ValueError(f"the dot8 layout needs a group that is a multiple of 8, got {group}")
        p = _panels(q.to(torch.uint8))  # [P, K, 16]
        if layout == "dot8":
            # [P, K, 16] -> [P, b, h, t, j] with k = 8b + 4h + t -> bytes [P, b, j, t]: low nibble h = 0.
            blocks = p.view(p.shape[0], k // 8, 2, 4, PANEL).permute(0, 1, 4, 3, 2)
            packed = (blocks[..., 0] | (blocks[..., 1] << 4)).reshape(p.shape[0], k // 8, 64)
        elif layout == "pairs":
            packed = p[:, 0::2, :] | (p[:, 1::2, :] << 4)
        else:
            raise ValueError(f"unknown 4-bit layout {layout!r}")
        # dot8 keeps scales and mins in float16 (exact for GGUF's Q4_0/Q4_1): a decode stream is bound by weight
        # bytes, and fp32 ones were a third of them.
        sdtype = torch.float16 if layout == "dot8" else torch.float32
        return cls(packed.contiguous(), _panels(scales.float()).to(sdtype), _panels(mins.float()).to(sdtype), group,
                   n, k, layout=layout)

    @classmethod
    def pack_f8(cls, q: torch.Tensor, scales: torch.Tensor) -> QPanels | QRows:
        """q float8_e4m3fn (or its uint8 bytes) [N, K], scales float [N, K / group]: w = scale * q."""
        if platform_of(q).packs_quantized_by_rows:
            return QRows.pack_f8(q, scales)
        n, k = q.shape
        group = k // scales.shape[1]
        return cls(_panels(q.view(torch.uint8)), _panels(scales.float()), None, group, n, k, is_fp8=True)

    @property
    def is_q4(self) -> bool:
        return self.mins is not None

    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (reference and fallback path)."""
        p, rows, _ = self.qweight.shape
        if self.is_q4 and self.layout == "dot8":
            nib = self.qweight.view(p, rows, PANEL, 4)  # [P, b, j, t]
            q = torch.stack([nib & 15, nib >> 4], dim=-1)  # [P, b, j, t, h]
            q = q.permute(0, 1, 4, 3, 2).reshape(p, rows * 8, PANEL).float()
        elif self.is_q4:
            q = torch.empty(p, rows * 2, PANEL, dtype=torch.float32)
            q[:, 0::2, :] = (self.qweight & 15).float()
            q[:, 1::2, :] = (self.qweight >> 4).float()
        elif self.is_fp8:
            q = self.qweight.view(torch.float8_e4m3fn).float()
        else:
            q = self.qweight.float()
        s = self.scales.float().repeat_interleave(self.group, dim=1)
        w = q * s
        if self.mins is not None:
            w += self.mins.float().repeat_interleave(self.group, dim=1)
        return w.transpose(1, 2).reshape(p * PANEL, self.in_features)[: self.out_features]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
               isa: int | None = None) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] (+ bias); ``isa`` overrides the kernel ISA (see ``kernels.cpu.cpu_isa``)."""
        kernels = _kernels_for(x)
        if kernels is None:
            y = F.linear(x, self.dequantize().to(x.dtype), bias)
            return out.copy_(y) if out is not None else y
        isa = cpu_isa() if isa is None else isa
        if (self.dynamic_int8_activations and x.shape[0] >= W8A8_MIN_ROWS and isa in (0, 2)
                and kernels.w8a8_supported()):
            return kernels.w8a8_gemm(x, self.qweight, self.scales, self.out_features, bias, out)
        if self.is_q4 and self.layout == "dot8":
            return kernels.q4_dot_gemm(x, self.qweight, self.scales, self.mins, self.group, self.out_features, bias,
                                       out, isa)
        if self.is_fp8:
            return kernels.f8_gemm(x, self.qweight, self.scales, self.group, self.out_features, bias, out, isa)
        if self.is_q4:
            return kernels.q4_gemm(x, self.qweight, self.scales, self.mins, self.group, self.out_features, bias,
                                   out, isa)
        return kernels.q8_gemm(x, self.qweight, self.scales, self.group, self.out_features, bias, out, isa)


    def cpu_matmul(self) -> Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor] | None:
        """``matmul`` for float32 CPU inputs with the kernel and ISA chosen now: ``(x, bias, out) -> y``; None
        without the C++ kernels or off the CPU. A decode step makes ~120 matmuls: the dispatch above costs
        a few microseconds each."""
        kernels = platform_of(self.qweight).cpu_kernels(torch.float32)
        if kernels is None:
            return None
        isa = cpu_isa()
        qw, s, mins, g, n = self.qweight, self.scales, self.mins, self.group, self.out_features
        if self.is_q4 and self.layout == "dot8":
            dot8 = kernels.q4_dot_gemm
            return lambda x, bias, out: dot8(x, qw, s, mins, g, n, bias, out, isa)
        if self.is_fp8:
            f8 = kernels.f8_gemm
            return lambda x, bias, out: f8(x, qw, s, g, n, bias, out, isa)
        if self.is_q4:
            q4 = kernels.q4_gemm
            return lambda x, bias, out: q4(x, qw, s, mins, g, n, bias, out, isa)
        q8 = kernels.q8_gemm
        if self.dynamic_int8_activations and isa in (0, 2) and kernels.w8a8_supported():
            w8a8 = kernels.w8a8_gemm
            return lambda x, bias, out: (w8a8(x, qw, s, n, bias, out) if x.shape[0] >= W8A8_MIN_ROWS
                                         else q8(x, qw, s, g, n, bias, out, isa))
        return lambda x, bias, out: q8(x, qw, s, g, n, bias, out, isa)


def _kernels_for(x: torch.Tensor) -> Any | None:
    return platform_of(x).cpu_kernels(x.dtype)


def quantize_q8(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per (row, group): w [N, K] -> (q int8 [N, K], scales float32 [N, K / group])."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    scales = g.abs().amax(-1) / 127.0
    q = torch.round(g / scales.clamp_min(1e-30).unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.view(n, k), scales


def quantize_q4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per (row, group): w ~= scale * q + min, q in 0..15.

    w [N, K] -> (q uint8 [N, K], scales float32 [N, K / group], mins float32 [N, K / group]).
    """
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = (hi - lo) / 15.0
    q = torch.round((g - lo.unsqueeze(-1)) / scales.clamp_min(1e-30).unsqueeze(-1)).clamp_(0, 15)
    return q.to(torch.uint8).view(n, k), scales, lo


def quantize_f8(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3fn per (row, group), the largest magnitude mapped to 448: w [N, K] -> (q float8_e4m3fn [N, K],
    scales float32 [N, K / group]); w ~= scale * q, rounding to the nearest e4m3 value."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    scales = g.abs().amax(-1) / FP8_MAX
    q = (g / scales.clamp_min(1e-30).unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, k), scales
