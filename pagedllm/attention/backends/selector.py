"""The backend of an attention layer that was built without one (outside ``load_model``: tests, tools): it
asks the registry for the best backend of each call's tensors' platform. An engine's layers get theirs once,
from the engine's platform and ``--attention-backend`` (``Worker``)."""

from __future__ import annotations

from collections.abc import Collection

import torch

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.backends.registry import get_attention_backend
from pagedllm.attention.key_rotation import KeyRotation
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec
from pagedllm.platforms import platform_of


class DeviceAttentionBackend(AttentionBackend):
    """Whatever ``get_attention_backend(platform_of(query))`` is: the C++ kernels on a CPU that built them,
    Triton on CUDA (imported on the first CUDA call only, so CPU processes never pay for it), else torch."""

    name = "auto"

    def takes_kv_from_rotary(self, qkv: torch.Tensor) -> bool:
        return get_attention_backend(platform_of(qkv)).takes_kv_from_rotary(qkv)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        get_attention_backend(platform_of(key)).write_kv(kv_cache, key, value, slot_mapping, kv_scale)

    def rotate_heads_(self, x: torch.Tensor, rotation: KeyRotation, which: str) -> None:
        get_attention_backend(platform_of(x)).rotate_heads_(x, rotation, which)

    def prepare_step(self, meta: AttentionMetadata, specs: Collection[AttentionSpec]) -> None:
        get_attention_backend(platform_of(meta.seq_lens)).prepare_step(meta, specs)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata, spec: AttentionSpec, scale: float,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        return get_attention_backend(platform_of(query)).forward(query, key, value, kv_cache, meta, spec, scale,
                                                                 kv_scale)
