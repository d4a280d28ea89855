"""Linear layers: BLAS for batches, a weight-streaming kernel for the few-row matmuls of small decode steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import kernels_for
from pagedllm.logger import init_logger

logger = init_logger(__name__)

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


class PrepackedWeight:
    """A frozen [N, K] weight that batches of more than a few rows multiply in oneDNN's own layout.

    For the LM head (49152 x 576 on the default model) oneDNN with a packed weight beats BLAS on the plain
    one by ~1.5x at 16-200 rows (2 cores: 17 vs 30 ms at 16 rows, ~90 vs ~130 ms at 200). The packed copy
    is made on first use and costs the weight's size again, so it is kept for the head only.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self._packed: torch.Tensor | None = None
        self._usable = (weight.device.type == "cpu" and weight.dtype == torch.float32
                        and torch.backends.mkldnn.is_available())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] -> [M, N]."""
        if self._usable and x.dim() == 2 and x.shape[0] > SMALL_GEMM_MAX_ROWS and x.dtype == torch.float32:
            try:
                if self._packed is None:
                    self._packed = self.weight.detach().to_mkldnn()
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, None, "none", [], "")
            except RuntimeError as e:  # a torch build without this oneDNN op: plain BLAS from now on
                logger.warning("oneDNN packed matmul unavailable (%s); using BLAS for the LM head", e)
                self._usable, self._packed = False, None
        return linear(x, self.weight)
