"""Which family of packed layouts a quantization method packs into: the one its platform's kernels read."""

from __future__ import annotations

import torch

from pagedllm.model_executor.layers.quantization.qpanels import QPanels
from pagedllm.model_executor.layers.quantization.qrows import QRows
from pagedllm.platforms import platform_of


def layout_for(t: torch.Tensor) -> type[QPanels] | type[QRows]:
    """The family for a weight that lives where ``t`` does (a layer's parameter): rows for the Triton kernel
    where the platform packs by rows (CUDA), else the C++ kernels' panels. Both offer ``pack_q8``,
    ``pack_w8a8``, ``pack_q4`` and ``pack_f8``."""
    return QRows if platform_of(t).packs_quantized_by_rows else QPanels
