"""Linear layers: BLAS for batches, a weight-streaming kernel for the few-row matmuls of small decode steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import kernels_for

# Up to this many rows the CPU kernel reads each weight row once for all of them (measured on the default
# model's shapes, 2 cores: M=1 27 ms vs 40 ms per full pass over the weights, M=8 44 ms vs 81 ms); above it
# BLAS is faster.
SMALL_GEMM_MAX_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K], bias: [N] or None -> [M, N]."""
    if x.dim() == 2 and 1 <= x.shape[0] <= SMALL_GEMM_MAX_ROWS and weight.dtype == x.dtype:
        kernels = kernels_for(x)
        if kernels is not None:
            return kernels.small_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` computed by :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
