"""What the CPU under this process can do, asked of torch once: facts the CPU platform answers from."""

from __future__ import annotations

import functools

import torch


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether bfloat16 weights can be prepacked for oneDNN (``torch.ops.mkldnn._linear_pointwise``, the op
    torch.compile's CPU backend emits): needs a CPU with native bf16 (AVX-512 BF16 / AMX)."""
    try:
        return (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False
