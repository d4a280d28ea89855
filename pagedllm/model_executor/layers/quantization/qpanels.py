"""Quantized weights in the panel layouts of the C++ CPU kernels: one class per format, each binding its kernel.

Every scheme (int8, int4, GGUF Q4_0/Q4_1/Q8_0, fp8, ...) ends as one of these, each with per-(row, group)
float scales, in panels of 16 output rows ``[P = ceil(N / 16), ..., 16]`` zero-padded past N:

- ``Int8Panels`` (``q8_gemm``): w = scale * q, q int8 [P, K, 16];
- ``W8A8Panels``: the same weight, and from ``W8A8_MIN_ROWS`` rows on a CPU with VNNI the activations
  quantized per row to int8 too (``w8a8_gemm``);
- ``Int8Dot4Panels`` (``q8_dot_gemm``, kernels/csrc/q8_dot_gemm.cpp): the same w = scale * q, q + 128 in 64-byte
  blocks of 4 k x 16 columns [P, K/4, 64], x quantized per group to int8 and multiplied by AVX-512 VNNI byte dot
  products (CPUs with VNNI; the autotuner chooses it over ``Int8Panels`` where it measures faster);
  ``dot8`` and ``dot4`` weights also run on AMX tiles (isa ``AMX_ISA``, kernels/csrc/amx_dot.h) with the same
  results, which the autotuner times per row count where the CPU has them (they win for many rows), and on the
  "words" tiles of every ISA (isa ``| WORDS``, kernels/csrc/words_gemm.h: the panels widened to int16 once per
  block of rows, x as one int16 term; faster for many rows, equal within float32 rounding);
- ``Q4Dot8Panels`` (``q4_dot_gemm``, kernels/csrc/q4_dot_gemm.cpp): w = scale * q + min, q in 0..15 in
  64-byte blocks of 8 k x 16 columns [P, K/8, 64]; x is quantized per group to int8 and multiplied by byte dot
  products, about twice the speed of widening the weights to float. The default wherever the group is a
  multiple of 8; its scales and mins are float16;
- ``Q4PairsPanels`` (``q4_gemm``, quant_gemm.cpp): the same levels as nibble pairs along K [P, K/2, 16],
  float activations;
- ``Fp8Panels`` (``f8_gemm``): w = scale * fp8(q), q the bytes of float8 e4m3fn values [P, K, 16].

``QPanels.pack_*`` build them from quantized rows; ``quantize_*`` make those rows from float weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.kernels.cpu import cpu_isa
from pagedllm.model_executor.layers.quantization.base import CpuMatmul
from pagedllm.model_executor.layers.quantization.packed_weight import PackedWeight
from pagedllm.platforms import platform_of

PANEL = 16
FP8_MAX = 448.0  # largest finite float8 e4m3fn
W8A8_MIN_ROWS = 16  # below this the weight-only kernel (weight-bound) is as fast and exact in x
W8A8_ISAS = (0, 2)  # auto, avx512: the VNNI kernels (w8a8, q8 dot4) have no AVX2 path
AMX_ISA = 4  # the byte-dot-product layouts' AMX tiles (kernels/csrc/amx_dot.h): only where amx_dot_supported()
AMX_LAYOUTS = ("dot8", "dot4")
WORDS = 8  # a flag on an ISA code: the byte-dot layouts' words tiles (kernels/csrc/words_gemm.h)
#: The largest group the words tiles take per layout (their int32 sums stay exact below it).
WORDS_MAX_GROUP = {"dot8": 4096, "dot4": 256}


def _present_isa(kernels: Any, isa: int) -> int:
    """``isa``, or this CPU's best (0) for AMX tiles it does not have (a table forced from another machine)."""
    return 0 if isa == AMX_ISA and not kernels.amx_dot_supported() else isa


def fp16_exact(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is a float16 value (GGUF's block scales are), so a float16 copy loses nothing."""
    return bool((t.half().float() == t.float()).all())


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N / 16), C, 16], zero-padded past N."""
    n, c = t.shape
    padded = -(-n // PANEL) * PANEL
    t = F.pad(t, (0, 0, 0, padded - n))
    return t.view(padded // PANEL, PANEL, c).transpose(1, 2).contiguous()


class QPanels(PackedWeight):
    """A quantized weight in the CPU kernels' panels. ``scales`` / ``mins`` [P, K/group, 16]."""

    layout = "panels"

    @classmethod
    def pack_q8(cls, q: torch.Tensor, scales: torch.Tensor) -> Int8Panels:
        """q int8 [N, K], scales float [N, K / group]."""
        return Int8Panels.pack(q, scales)

    @classmethod
    def pack_w8a8(cls, q: torch.Tensor, scales: torch.Tensor) -> W8A8Panels:
        """As ``pack_q8``, activations quantized to int8 for many rows (per channel: one group per row)."""
        return W8A8Panels.pack(q, scales)

    @classmethod
    def pack_q4(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, layout: str | None = None
                ) -> Q4Dot8Panels | Q4PairsPanels:
        """q uint8 values 0..15 [N, K] (K even), scales / mins float [N, K / group].

        ``layout``: "dot8" or "pairs" (module docstring); default dot8 where the group is a multiple of 8
        (``PAGEDLLM_Q4_LAYOUT=pairs`` picks the old layout, for comparisons).
        """
        group = q.shape[1] // scales.shape[1]
        if layout is None:
            layout = envs.PAGEDLLM_Q4_LAYOUT if group % 8 == 0 else "pairs"
        formats = {"dot8": Q4Dot8Panels, "pairs": Q4PairsPanels}
        if layout not in formats:
            raise ValueError(f"unknown 4-bit layout {layout!r}")
        return formats[layout].pack(q, scales, mins)

    @classmethod
    def pack_f8(cls, q: torch.Tensor, scales: torch.Tensor) -> Fp8Panels:
        """q float8_e4m3fn (or its uint8 bytes) [N, K], scales float [N, K / group]: w = scale * q."""
        return Fp8Panels.pack(q, scales)

    def bind(self, isa: int | None = None) -> CpuMatmul | None:
        kernels = platform_of(self.qweight).cpu_kernels(torch.float32)
        if kernels is None:
            return None
        return self._bind_kernel(kernels, cpu_isa() if isa is None else isa)

    def _bind_kernel(self, kernels: Any, isa: int) -> CpuMatmul:
        """The C++ call for this format: ``(x, bias, out) -> y`` with the weight's tensors and ``isa`` fixed."""
        raise NotImplementedError

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32

    def cpu_matmul(self) -> CpuMatmul | None:
        return self._kernel

    def fast_matmul(self) -> CpuMatmul:
        kernel, matmul = self._kernel, self.matmul
        if kernel is None:
            return matmul

        def run(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
            return kernel(x, bias, out) if x.dtype == torch.float32 else matmul(x, bias, out)

        return run

    def _levels(self) -> torch.Tensor:
        """The quantized levels as float32 [P, K, 16]."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        p = self.qweight.shape[0]
        s = self.scales.float().repeat_interleave(self.group, dim=1)
        w = self._levels() * s
        if self.mins is not None:
            w += self.mins.float().repeat_interleave(self.group, dim=1)
        return w.transpose(1, 2).reshape(p * PANEL, self.in_features)[: self.out_features]


class Int8Panels(QPanels):
    """``qweight`` int8 [P, K, 16], ``scales`` float32: w = scale * q."""

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor) -> Int8Panels:
        n, k = q.shape
        return cls(_panels(q.to(torch.int8)), _panels(scales.float()), None, k // scales.shape[1], n, k)

    def _bind_kernel(self, kernels: Any, isa: int) -> CpuMatmul:
        q8, qw, s, g, n = kernels.q8_gemm, self.qweight, self.scales, self.group, self.out_features
        return lambda x, bias, out: q8(x, qw, s, g, n, bias, out, isa)

    def _levels(self) -> torch.Tensor:
        return self.qweight.float()


class Int8Dot4Panels(QPanels):
    """``qweight`` uint8 [P, K/4, 64]: block b holds k = 4b..4b+3 of 16 columns, byte 4j + t the level of
    k = 4b + t of column j plus 128; ``scales`` float16 where that is exact (GGUF's Q8_0), else float32."""

    layout = "dot4"

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor) -> Int8Dot4Panels:
        """q int8 [N, K], scales float [N, K / group] (group a multiple of 4)."""
        n, k = q.shape
        group = k // scales.shape[1]
        if group % 4:
            raise ValueError(f"the dot4 layout needs a group that is a multiple of 4, got {group}")
        p = _panels(q.to(torch.int16) + 128)  # [P, K, 16], levels 1..255
        # [P, K, 16] -> [P, b, t, j] with k = 4b + t -> bytes [P, b, j, t].
        packed = p.view(p.shape[0], k // 4, 4, PANEL).transpose(2, 3).reshape(p.shape[0], k // 4, 64)
        s = _panels(scales.float())
        return cls(packed.to(torch.uint8).contiguous(), s.half() if fp16_exact(s) else s, None, group, n, k)

    def _bind_kernel(self, kernels: Any, isa: int) -> CpuMatmul:
        isa = _present_isa(kernels, isa)
        if isa != AMX_ISA and not isa & WORDS and (isa not in W8A8_ISAS or not kernels.q8_dot_supported()):
            isa = 3  # no VNNI: the portable loop (same results, slow; the autotuner never picks it there)
        dot4, qw, s, g, n = kernels.q8_dot_gemm, self.qweight, self.scales, self.group, self.out_features
        return lambda x, bias, out: dot4(x, qw, s, g, n, bias, out, isa)

    def _levels(self) -> torch.Tensor:
        p, blocks, _ = self.qweight.shape
        u = self.qweight.view(p, blocks, PANEL, 4).transpose(2, 3)  # [P, b, t, j]
        return u.reshape(p, blocks * 4, PANEL).float() - 128


class W8A8Panels(Int8Panels):
    """``Int8Panels`` whose activations are quantized per row to int8 for ``W8A8_MIN_ROWS``+ rows where the CPU
    has AVX-512 VNNI (the weight-only kernel otherwise, and for fewer rows)."""

    def _bind_kernel(self, kernels: Any, isa: int) -> CpuMatmul:
        if isa not in W8A8_ISAS or not kernels.w8a8_supported():
            return super()._bind_kernel(kernels, isa)
        q8, w8a8 = kernels.q8_gemm, kernels.w8a8_gemm
        qw, s, g, n = self.qweight, self.scales, self.group, self.out_features
        return lambda x, bias, out: (w8a8(x, qw, s, n, bias, out) if x.shape[0] >= W8A8_MIN_ROWS
                                     else q8(x, qw, s, g, n, bias, out, isa))


class Q4Dot8Panels(QPanels):
    """``qweight`` uint8 [P, K/8, 64]: block b holds k = 8b..8b+7 of 16 columns, byte (j, t) the levels of
    k = 8b + t (low nibble) and 8b + 4 + t (high) of column j; ``scales`` / ``mins`` float16."""

    layout = "dot8"
    is_q4 = True

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Q4Dot8Panels:
        n, k = q.shape
        group = k // scales.shape[1]
        if group % 8:
            raise ValueError(f"the dot8 layout needs a group that is a multiple of 8, got {group}")
        p = _panels(q.to(torch.uint8))  # [P, K, 16]
        # [P, K, 16] -> [P, b, h, t, j] with k = 8b + 4h + t -> bytes [P, b, j, t]: low nibble h = 0.
        blocks = p.view(p.shape[0], k // 8, 2, 4, PANEL).permute(0, 1, 4, 3, 2)
        packed = (blocks[..., 0] | (blocks[..., 1] << 4)).reshape(p.shape[0], k // 8, 64)
        # float16 scales and mins (exact for GGUF's Q4_0/Q4_1): a decode stream is bound by weight bytes, and
        # fp32 ones were a third of them.
        return cls(packed.contiguous(), _panels(scales.float()).to(torch.float16),
                   _panels(mins.float()).to(torch.float16), group, n, k)

    def _bind_kernel(self, kernels: Any, isa: int) -> CpuMatmul:
        isa = _present_isa(kernels, isa)
        dot8, qw, s, mins = kernels.q4_dot_gemm, self.qweight, self.scales, self.mins
        g, n = self.group, self.out_features
        return lambda x, bias, out: dot8(x, qw, s, mins, g, n, bias, out, isa)

    def _levels(self) -> torch.Tensor:
        p, blocks, _ = self.qweight.shape
        nib = self.qweight.view(p, blocks, PANEL, 4)  # [P, b, j, t]
        q = torch.stack([nib & 15, nib >> 4], dim=-1)  # [P, b, j, t, h]
        return q.permute(0, 1, 4, 3, 2).reshape(p, blocks * 8, PANEL).float()


class Q4PairsPanels(QPanels):
    """``qweight`` uint8 [P, K/2, 16]: k = 2i in the low nibble of row i, 2i + 1 in the high; ``scales`` /
    ``mins`` float32."""

    layout = "pairs"
    is_q4 = True

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Q4PairsPanels:
        n, k = q.shape
        p = _panels(q.to(torch.uint8))  # [P, K, 16]
        packed = p[:, 0::2, :] | (p[:, 1::2, :] << 4)
        return cls(packed.contiguous(), _panels(scales.float()), _panels(mins.float()), k // scales.shape[1], n, k)

    def _bind_kernel(self, kernels: Any, isa: int) -> CpuMatmul:
        q4, qw, s, mins = kernels.q4_gemm, self.qweight, self.scales, self.mins
        g, n = self.group, self.out_features
        return lambda x, bias, out: q4(x, qw, s, mins, g, n, bias, out, isa)

    def _levels(self) -> torch.Tensor:
        p, rows, _ = self.qweight.shape
        q = torch.empty(p, rows * 2, PANEL, dtype=torch.float32)
        q[:, 0::2, :] = (self.qweight & 15).float()
        q[:, 1::2, :] = (self.qweight >> 4).float()
        return q


class Fp8Panels(QPanels):
    """``qweight`` uint8 [P, K, 16] (float8 e4m3fn bit patterns), ``scales`` float32: w = scale * q."""

    @classmethod
    def pack(cls, q: torch.Tensor, scales: torch.Tensor) -> Fp8Panels:
        n, k = q.shape
        return cls(_panels(q.view(torch.uint8)), _panels(scales.float()), None, k // scales.shape[1], n, k)

    def _bind_kernel(self, kernels: Any, isa: int) -> CpuMatmul:
        f8, qw, s, g, n = kernels.f8_gemm, self.qweight, self.scales, self.group, self.out_features
        return lambda x, bias, out: f8(x, qw, s, g, n, bias, out, isa)

    def _levels(self) -> torch.Tensor:
        return self.qweight.view(torch.float8_e4m3fn).float()


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
