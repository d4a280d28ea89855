"""The attention layer models use: projections are the model's, paging is ours."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backends.torch_sdpa import paged_attention
from pagedllm.attention.forward_context import get_attn_metadata


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention over the KV cache bound to this layer.

    The model runner binds ``kv_cache`` ([2, num_blocks, block_size, Hkv, D]) after allocating it.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.layer_idx = layer_idx
        self.kv_cache: torch.Tensor | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query: [T, H*D], key/value: [T, Hkv*D] -> [T, H*D]."""
        if self.kv_cache is None:
            raise RuntimeError(f"no KV cache bound to attention layer {self.layer_idx}")
        t = query.shape[0]
        out = paged_attention(
            query.view(t, self.num_heads, self.head_size),
            key.view(t, self.num_kv_heads, self.head_size),
            value.view(t, self.num_kv_heads, self.head_size),
            self.kv_cache, get_attn_metadata(), self.scale)
        return out.view(t, self.num_heads * self.head_size)


def bind_kv_caches(model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
    """Give each Attention layer (by ``layer_idx``) its cache tensor."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(kv_caches):
        raise ValueError(f"model has {len(layers)} attention layers but {len(kv_caches)} KV caches")
    for layer in layers:
        layer.kv_cache = kv_caches[layer.layer_idx]
