"""Which fused element-wise kernels serve a tensor: the C++ CPU kernels (float32 CPU tensors) or the
Triton ops (CUDA tensors, when triton is installed, as it is with CUDA builds of torch). Both expose
``rms_norm_``, ``silu_and_mul`` and ``rotary_`` with the same calling conventions."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.kernels.cpu import kernels_for


def elementwise_kernels_for(t: torch.Tensor) -> Any | None:
    """The kernels module for ``t``'s device and dtype, or None (then layers use plain torch ops)."""
    if t.is_cuda:
        from pagedllm.kernels import triton_ops

        return triton_ops.TRITON_OPS if triton_ops.triton_available() else None
    return kernels_for(t)
