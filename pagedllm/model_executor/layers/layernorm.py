"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.cpu import kernels_for


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim; statistics in float32, output in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden]. With ``residual`` ([T, hidden]) returns (norm(x + residual), x + residual).

        On CPU in float32 one fused pass computes it, writing the results into ``x`` and ``residual``
        (callers hand over both); without a residual ``x`` is left as it is.
        """
        kernels = kernels_for(x)
        if kernels is not None and x.dim() == 2 and self.weight.dtype == x.dtype:
            if residual is None:
                out = x.clone()
                kernels.rms_norm_(out, None, self.weight, self.eps)
                return out
            kernels.rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            # The residual stream stays in the model dtype, as in the reference implementations.
            x = x + residual
            residual = x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)
