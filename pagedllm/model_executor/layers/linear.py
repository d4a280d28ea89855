"""Linear layers, and the packed weight layout the CPU matmul kernel reads.

On a CPU with the C++ kernels (float32 weights), every ``Linear`` is repacked once after loading into
panels of 16 output columns (``kernels/csrc/packed_gemm.cpp``). The packed copy replaces the weight, so
memory does not grow; matmuls then skip BLAS's per-call repacking. Measured on the default model's shapes,
2 cores: 1.1-1.4x MKL at 200 rows, 1.05-1.15x at 2048, ~2.5x at 1-32 rows. Elsewhere (GPU, bf16, no
compiler) layers stay plain ``F.linear``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import kernels_for

PANEL = 16  # output columns per panel; must match NR in packed_gemm.cpp


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 16), K, 16] panels (zero-padded past N), what ``packed_gemm`` reads."""
    n, k = weight.shape
    padded_n = -(-n // PANEL) * PANEL
    w = F.pad(weight.detach(), (0, 0, 0, padded_n - n))
    return w.view(padded_n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def packed_linear(kernels: Any, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with W given packed -> [..., out_features].

    ``out``: optional [M, out_features] float32 destination (M = rows of x), returned when given.
    """
    lead = x.shape[:-1]
    y = kernels.packed_gemm(x.reshape(-1, x.shape[-1]), packed, out_features, bias, out)
    return y if out is not None else y.view(*lead, out_features)


class Linear(nn.Linear):
    """``nn.Linear`` that can swap its weight for the CPU kernel's packed layout (``pack_for_cpu``)."""

    packed_weight: torch.Tensor | None = None
    _kernels: Any = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]. ``out``: optional [M, N] float32 destination, used by the packed path."""
        if self.packed_weight is not None:
            return packed_linear(self._kernels, x, self.packed_weight, self.out_features, self.bias, out)
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self) -> bool:
        """Replace the loaded weight by its packed form if the CPU kernels apply; True if it did.

        Call after the weights are loaded: the plain weight is dropped (``self.weight`` becomes None).
        """
        if self.packed_weight is not None:
            return True
        kernels = kernels_for(self.weight)
        if kernels is None:
            return False
        self.packed_weight = pack_weight(self.weight)
        self._kernels = kernels
        self.weight = None  # the packed copy replaces it
        return True


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every layer of ``model`` that has ``pack_for_cpu`` (see ``Linear``); returns how many did."""
    return sum(bool(m.pack_for_cpu()) for m in model.modules() if hasattr(m, "pack_for_cpu"))
