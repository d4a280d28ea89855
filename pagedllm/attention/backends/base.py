"""The attention backend interface: one class per way of attending (portable torch, CPU kernel, CUDA ...).

Every backend reads the same ``AttentionMetadata`` (built once per step by
``attention.metadata.build_attention_metadata``) and is told each layer's ``AttentionSpec``; a backend
that cannot serve a spec falls back to the portable one inside its ``forward``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec


class AttentionBackend(ABC):
    name: str = "abstract"
    #: Reads no tensor values on the host, so a step through it can be captured as a CUDA graph.
    graph_safe: bool = False

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata, spec: AttentionSpec, scale: float) -> torch.Tensor:
        """query: [T, H, D]; key/value: [T, Hkv, D] (this step's new tokens) -> output [T, H, D].

        ``kv_cache`` ([2, num_blocks, block_size, Hkv, D]) receives this step's K/V by ``meta.slot_mapping``
        before any request reads it; it is None for encoder layers, which keep no cache. key/value None
        (only where ``takes_kv_from_rotary`` said yes): the step's K/V is in the cache already.
        """

    def takes_kv_from_rotary(self, qkv: torch.Tensor) -> bool:
        """Whether, for tensors like ``qkv``, this backend lets the rotary kernel write the step's K/V into the
        cache (``triton_ops.rotary_and_write_kv_``) and then attends with key = value = None."""
        return False
