"""A quantized weight's dense copy: the many-rows candidate of the CPU kernel autotuner (``kernel_choice.py``).

The group-wise quantized kernels (``qpanels.py``) are bound by weight bytes for a few rows, where they beat a
dense matmul, but their cost grows with the rows faster than a dense GEMM's (docs/performance.md). So each
quantized weight also offers the autotuner its dequantized copy, run by the dense GEMM of the CPU:

- ``dense-f32/blas``: float32 [N, K] through BLAS (``torch.addmm``): the same product as the quantized kernels
  within float32 rounding, so a request's tokens do not depend on the batch it runs in. The default.
- with ``PAGEDLLM_CPU_DENSE_COPY=bf16`` on CPUs with native bf16 (AVX-512 BF16 or AMX), bfloat16 copies
  instead: ``dense-bf16/onednn`` (oneDNN's prepacked layout, the result rounded to bf16 and widened back, the
  bias added in float32) and ``dense-bf16/panels`` (the C++ bf16 panels, ``bf16_gemm``, float32 sums written as
  they are). Half the bytes and faster, but the activations of many-row steps are rounded to bf16 while a few
  rows keep float32 (and the quantized kernels' two-int8-term activations keep ~16 bits): near-tied greedy
  tokens can then differ between batch sizes. An opt-in for throughput.

The LM head is offered only copies whose result stays float32 (``exact_output``: the bf16 panels, float32
BLAS): a logit of 16 rounded to bf16 moves by up to 0.06.

The autotuner times them against the quantized kernels per bucket of rows and keeps a copy only where a bucket
chooses it, from 33 rows on (``DENSE_FIRST_BUCKET``; the LM head at any row count); the start-up log says how
many bytes such copies add.
``PAGEDLLM_CPU_DENSE_COPY`` (``auto`` | ``on`` | ``off`` | ``bf16``) decides whether they are offered: ``auto``
offers them while the copies of the whole model fit in a quarter of the memory available (so a large model
quantized to fit never doubles its footprint), ``on`` and ``bf16`` always.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedllm import envs
from pagedllm.kernels.cpu import cpu_isa
from pagedllm.model_executor.layers.quantization.base import CpuMatmul
from pagedllm.model_executor.layers.quantization.float_weights import nbytes_of, pack_bf16_weight
from pagedllm.model_executor.layers.quantization.packed_weight import PackedWeight
from pagedllm.platforms import platform_of

PREFIX = "dense-"  # candidate names: "dense-f32/blas", "dense-bf16/onednn", "dense-bf16/panels"
#: The first bucket of rows (``autotune.BUCKET_ROWS``: 33-128) a dense copy may be chosen for: smaller batches
#: run in CPU step graphs (decode batches 1..16), which its torch ops (the bf16 conversion, oneDNN) would end.
#: The LM head runs after the graph (logits of the sampled rows): its copies compete at every bucket.
DENSE_FIRST_BUCKET = 3
AVX2_ISA = 1  # ``cpu_isa()``'s code for a forced AVX2
BUDGET_FRACTION = 0.25  # ``auto``: the copies of a model may take this share of the available memory


def is_dense(name: str) -> bool:
    """Whether an autotuner candidate name is a dense copy's."""
    return name.startswith(PREFIX)


class DenseCopy:
    """The dequantized copy of a quantized weight [N, K], made once (lazily), in ``dtype`` (bf16 or float32),
    for kernel ``kind`` ("onednn", "panels" or "blas"). ``bind`` and ``nbytes`` as a ``PackedWeight``'s, so the
    autotuner builds a layer's per-bucket kernel from either."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype, kind: str, kernels: Any) -> None:
        self.source, self.dtype, self.kind, self.kernels = weight, dtype, kind, kernels
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        """The copy in its kernel's layout: oneDNN's blocked bf16, bf16 panels [ceil(N/16), K/2, 16, 2], or
        float32 rows [N, K]."""
        if self._tensor is None:
            w = self.source.dequantize()  # float32 [N, K], exact
            if self.kind == "blas":
                self._tensor = w.contiguous()
            elif self.kind == "panels":
                self._tensor = pack_bf16_weight(w.to(torch.bfloat16))
            else:
                self._tensor = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), None)
        return self._tensor

    def nbytes(self) -> int:
        return nbytes_of(self.tensor)

    def bind(self, isa: int | None = None) -> CpuMatmul:
        """``(x float32 [M, K], bias float32 [N] | None, out float32 [M, N] | None) -> [M, N]`` on the copy."""
        w, n = self.tensor, self.out_features
        if self.kind == "blas":
            def blas(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
                return torch.addmm(bias, x, w.T, out=out) if bias is not None else torch.mm(x, w.T, out=out)

            return blas
        if self.kind == "panels":
            gemm = self.kernels.bf16_gemm

            def panels(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
                if out is None:
                    out = torch.empty(x.shape[0], n, dtype=torch.float32)
                gemm(x.to(torch.bfloat16), w, n, None, out)  # float32 sums written into ``out``
                return out.add_(bias) if bias is not None else out

            panels.__name__ = "dense_bf16_panels"
            return panels

        def product(xb: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(xb, w, None, "none", [], "")

        def bf16(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
            y = product(x.to(torch.bfloat16).contiguous())
            if out is None:
                out = y.float()
            else:
                out.copy_(y)
            return out.add_(bias) if bias is not None else out  # the bias in float32, as the quantized kernels

        bf16.__name__ = f"dense_bf16_{self.kind}"
        return bf16


def bf16_copies() -> bool:
    """Whether dense copies are bf16 where the CPU has native bf16 (``PAGEDLLM_CPU_DENSE_COPY=bf16``)."""
    return envs.PAGEDLLM_CPU_DENSE_COPY == "bf16"


def _native_bf16(platform: Any) -> bool:
    """bf16 GEMMs run natively here (and the kernels' ISA is not forced to AVX2, which stands for a CPU without
    them: ``make test-avx2``)."""
    return platform.onednn_bf16() and cpu_isa() != AVX2_ISA


def dense_candidates(weight: PackedWeight, exact_output: bool = False) -> dict[str, Callable[[], DenseCopy]]:
    """name -> a maker of the weight's dense copy for that kernel, for the CPU at hand (empty where none runs);
    each builds its copy only when called. ``exact_output``: only kernels whose result is not rounded to bf16
    (the LM head's logits; module docstring)."""
    platform = platform_of(weight.qweight)
    if platform.cpu_kernels_family(torch.float32) is None:  # not a CPU: the autotuner's candidates are CPU kernels
        return {}
    out: dict[str, Callable[[], DenseCopy]] = {}
    if bf16_copies() and _native_bf16(platform):
        kernels = platform.cpu_kernels(torch.bfloat16, (torch.bfloat16,))
        if not exact_output:
            out[f"{PREFIX}bf16/onednn"] = lambda: DenseCopy(weight, torch.bfloat16, "onednn", None)
        if (kernels is not None and hasattr(kernels, "bf16_gemm") and kernels.bf16_gemm_supported()
                and weight.in_features % 2 == 0):
            out[f"{PREFIX}bf16/panels"] = lambda: DenseCopy(weight, torch.bfloat16, "panels", kernels)
    if not out:
        out[f"{PREFIX}f32/blas"] = lambda: DenseCopy(weight, torch.float32, "blas", None)
    return out


def dense_nbytes(weight: PackedWeight) -> int:
    """Bytes one dense copy of ``weight`` takes on this CPU (bf16 where ``bf16_copies()`` and the CPU has native
    bf16, else float32)."""
    per = 2 if bf16_copies() and _native_bf16(platform_of(weight.qweight)) else 4
    return weight.out_features * weight.in_features * per


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def dense_copies_allowed(total_nbytes: int, available: int | None = None) -> tuple[bool, str]:
    """Whether the autotuner may offer dense copies taking at most ``total_nbytes`` (every quantized layer's),
    and why not where it may not. ``available``: the memory available (default: the host's, /proc/meminfo)."""
    mode = envs.PAGEDLLM_CPU_DENSE_COPY
    if mode == "off":
        return False, "PAGEDLLM_CPU_DENSE_COPY=off"
    if mode in ("on", "bf16"):
        return True, ""
    available = _available_memory() if available is None else available
    if available and total_nbytes > BUDGET_FRACTION * available:
        return False, (f"their {total_nbytes / 2**20:.0f} MiB would exceed a quarter of the "
                       f"{available / 2**20:.0f} MiB available (PAGEDLLM_CPU_DENSE_COPY=on offers them anyway)")
    return True, ""
