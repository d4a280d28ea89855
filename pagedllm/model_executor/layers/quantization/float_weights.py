"""Float weights as ``BoundWeight`` forms: the plain tensor (``F.linear``) and float32 panels for the C++ kernel.

On a CPU with the C++ kernels a float32 weight is repacked after loading into panels of 16 output columns
(``kernels/csrc/packed_gemm.cpp``), which replace the plain weight: matmuls then skip BLAS's per-call
repacking. The autotuner (``kernel_choice.py``) may give BLAS on the plain rows some buckets of rows, where
the machine's BLAS measures faster; the weight then keeps the copies its buckets read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.kernels import autotune
from pagedllm.model_executor.layers.quantization.base import CpuMatmul
from pagedllm.model_executor.layers.quantization.bound_weight import BoundWeight

PANEL = 16  # output columns per panel; must match NR in packed_gemm.cpp / quant_gemm.cpp


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 16), K, 16] panels (zero-padded past N), what ``packed_gemm`` reads."""
    n, k = weight.shape
    padded_n = -(-n // PANEL) * PANEL
    w = F.pad(weight.detach(), (0, 0, 0, padded_n - n))
    return w.view(padded_n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weight [N, K] (K even) -> [ceil(N / 16), K / 2, 16, 2] panels (zero-padded past N), what ``bf16_gemm``
    reads: one 64-byte row per pair of k, the operand of one AVX-512 BF16 dot product."""
    panels = pack_weight(weight)  # [P, K, 16]: the float panels, whose k rows pair up
    p, k, _ = panels.shape
    return panels.view(p, k // 2, 2, PANEL).transpose(2, 3).contiguous()


def unpack_rows(panels: torch.Tensor, n: int) -> torch.Tensor:
    """Panels [P, K, 16] -> the plain weight [N, K] (the inverse of ``pack_weight``), contiguous."""
    p, k, _ = panels.shape
    return panels.transpose(1, 2).reshape(p * PANEL, k)[:n].contiguous()


def nbytes_of(*tensors: torch.Tensor | None) -> int:
    """Bytes of the tensors given (None skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def per_bucket(kernels: dict[str, CpuMatmul], choices: Sequence[str]) -> CpuMatmul:
    """One kernel that runs ``kernels[choices[b]]`` for a batch in bucket b of rows (``autotune.BUCKET_ROWS``);
    the kernel itself where every bucket chose it."""
    return autotune.by_rows([kernels[name] for name in choices])


class PlainWeight(BoundWeight):
    """The weight [N, K] as loaded, the layer's ``weight`` parameter, multiplied by ``F.linear`` (GPUs; dtypes
    no C++ kernel packs). ``out`` is not written: the caller takes the result."""

    in_layer_parameters = True

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def nbytes(self) -> int:
        return nbytes_of(self.weight)

    def describe(self) -> str:
        return str(self.weight.dtype).removeprefix("torch.")


class Float32Panels(BoundWeight):
    """A float32 weight for the C++ kernel's panels (``panels`` [ceil(N/16), K, 16], ``packed_gemm``) and, for
    the buckets of rows the autotuner gave BLAS, its plain rows (``rows`` [N, K], ``torch.addmm``). ``choices``:
    the kernel of each bucket, a name of ``CANDIDATES``; ``kernels``: the C++ kernels module."""

    CANDIDATES = ("panels", "blas")  # the first: the packing's own kernel

    def __init__(self, panels: torch.Tensor | None, rows: torch.Tensor | None, out_features: int,
                 in_features: int, kernels: Any, choices: Sequence[str] | None = None) -> None:
        self.panels, self.rows = panels, rows
        self.out_features, self.in_features = out_features, in_features
        self.kernels = kernels
        self.choices = tuple(choices or ("panels",) * len(autotune.BUCKET_ROWS))
        self._kernel = per_bucket({name: self._make(name) for name in dict.fromkeys(self.choices)}, self.choices)

    @classmethod
    def pack(cls, weight: torch.Tensor, kernels: Any) -> Float32Panels:
        """weight float32 [N, K] -> its panels, every bucket on them."""
        n, k = weight.shape
        return cls(pack_weight(weight), None, n, k, kernels)

    def _make(self, name: str) -> CpuMatmul:
        if name == "panels":
            gemm, packed, n = self.kernels.packed_gemm, self.panels, self.out_features

            def panels(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
                return gemm(x, packed, n, bias, out)

            return panels
        w = self.rows if self.rows is not None else unpack_rows(self.panels, self.out_features)

        def blas(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
            return torch.addmm(bias, x, w.T, out=out) if bias is not None else torch.mm(x, w.T, out=out)

        return blas

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernel(x, bias, out)

    def fast_matmul(self) -> CpuMatmul:
        return self._kernel

    def cpu_matmul(self) -> CpuMatmul | None:
        return self._kernel

    def nbytes(self) -> int:
        return nbytes_of(self.panels, self.rows)

    def describe(self) -> str:
        return "float32"

    # The autotuner's side (kernel_choice.py).
    def tuning_key(self) -> str:
        return f"Float32Panels:{self.out_features}x{self.in_features}"

    def candidates(self) -> dict[str, Callable[[], CpuMatmul]] | None:
        """name -> a maker of that kernel, to time; None where there is nothing to choose."""
        if self.panels is None:
            return None
        return {name: lambda name=name: self._make(name) for name in self.CANDIDATES}

    def with_choices(self, choices: Sequence[str]) -> Float32Panels:
        """This weight running ``choices[b]`` for bucket b: itself where that is the panels everywhere; BLAS
        everywhere keeps only the plain rows, a mix keeps both copies."""
        if set(choices) == {"panels"}:
            return self
        panels = self.panels if "panels" in choices else None
        rows = self.rows if self.rows is not None else unpack_rows(self.panels, self.out_features)
        return Float32Panels(panels, rows, self.out_features, self.in_features, self.kernels, choices)

    def extra_copy_nbytes(self) -> int:
        """Bytes of the second copy a mix of kernels keeps (0 for one kernel everywhere)."""
        return nbytes_of(self.rows) if self.panels is not None else 0
