"""Hand-built test metadata prepared as every caller prepares a step before running layers over it
(``AttentionBackend.prepare_step``): a forward over metadata nobody prepared raises."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec


class _WithKernels(TorchPagedAttentionBackend):
    """The torch backend's routing with ``kernels`` (real or a spy) where the CPU backend takes its C++ kernels."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def _kernels(self, tensor: torch.Tensor) -> Any:
        return self.kernels


def prepared(meta: AttentionMetadata, *specs: AttentionSpec, kernels: Any | None = None) -> AttentionMetadata:
    """``meta`` with the torch backend's state (the CPU backend's, given ``kernels``) built for layers of ``specs``
    (default: causal), as the model runner builds it once per step."""
    backend = TorchPagedAttentionBackend() if kernels is None else _WithKernels(kernels)
    backend.prepare_step(meta, specs or (AttentionSpec.causal(),))
    return meta
