"""RMSNorm (plain and Gemma's ``1 + w``) and LayerNorm, optionally fused with the residual add before them."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.kernel_binding import KernelBinding
from pagedllm.platforms import Platform


class RMSNorm(DirectCall, nn.Module):
    """Root-mean-square norm over the last dim; statistics in float32, output in the input dtype."""

    # Gemma stores w and scales by (1 + w); others scale by w.
    weight_offset: float = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self._kernels = KernelBinding(self._fused_family)

    def _fused_family(self, platform: Platform, dtype: torch.dtype) -> str | None:
        """The kernel family whose fused RMSNorm serves activations of ``dtype`` on ``platform``, or None. Gemma's
        (1 + w) is taken in float32 by the reference; the platform says whether its fused op matches that."""
        if self.weight_offset and not platform.fused_norm_keeps_offset_exact(dtype):
            return None
        return platform.elementwise_family(dtype)

    def _scale(self) -> torch.Tensor:
        return self.weight + self.weight_offset if self.weight_offset else self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden]. With ``residual`` ([T, hidden]) returns (norm(x + residual), x + residual).

        On CPU in float32 or bfloat16 (and on CUDA) one fused pass computes it, writing the results into ``x`` and
        ``residual`` (callers hand over both); without a residual ``x`` is left as it is.
        """
        kernels = self._kernels(x)
        if kernels is not None and x.dim() == 2 and self.weight.dtype == x.dtype:
            if residual is None:
                return kernels.rms_norm(x, self._scale(), self.eps)
            kernels.rms_norm_(x, residual, self._scale(), self.eps)
            return x, residual
        if residual is not None:
            # The residual stream stays in the model dtype, as in the reference implementations.
            x = x + residual
            residual = x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            out = (x32 * (self.weight.float() + self.weight_offset)).to(x.dtype)  # Gemma: scale in float32
        else:
            out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint holds w (zeros = identity) and the output is scaled by (1 + w)."""

    weight_offset = 1.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, dtype)
        with torch.no_grad():
            self.weight.zero_()


class LayerNorm(DirectCall, nn.LayerNorm):
    """LayerNorm with RMSNorm's calling convention (an optional residual added first)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps=eps, dtype=dtype)
        self._kernels = KernelBinding(lambda platform, dtype: platform.layer_norm_family(dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden]; with ``residual``: (norm(x + residual), x + residual).

        On CPU in float32 or bfloat16 one pass computes it (statistics in float32, one rounding, as torch's), writing
        the results into ``x`` and ``residual`` (callers hand over both); without a residual ``x`` is left as it is.
        """
        kernels = self._kernels(x)
        if kernels is not None and x.dim() == 2 and self.weight.dtype == self.bias.dtype == x.dtype:
            if residual is None:
                return kernels.layer_norm(x, self.weight, self.bias, self.eps)
            kernels.layer_norm_(x, residual, self.weight, self.bias, self.eps)
            return x, residual
        if residual is None:
            return super().forward(x)
        residual = x + residual
        return super().forward(residual), residual
