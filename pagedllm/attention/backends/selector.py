"""The backend a layer uses by default: chosen per call from the device its tensors live on."""

from __future__ import annotations

import torch

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec


class DeviceAttentionBackend(AttentionBackend):
    """CUDA tensors go to the Triton kernels (when triton is installed, as with CUDA builds of torch);
    everything else to the torch backend (the C++ kernel on CPU, the portable path elsewhere). Triton is
    imported on the first CUDA call only, so CPU processes never pay for it."""

    name = "auto"

    def __init__(self) -> None:
        self.torch_backend = TorchPagedAttentionBackend()
        self._cuda_backend: AttentionBackend | None = None
        self._cuda_checked = False

    def cuda_backend(self) -> AttentionBackend:
        if not self._cuda_checked:
            from pagedllm.attention.backends.triton_paged import TritonPagedAttentionBackend, triton_available

            if triton_available():
                self._cuda_backend = TritonPagedAttentionBackend(self.torch_backend)
            self._cuda_checked = True
        return self._cuda_backend or self.torch_backend

    def takes_kv_from_rotary(self, qkv: torch.Tensor) -> bool:
        return qkv.is_cuda and self.cuda_backend().takes_kv_from_rotary(qkv)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata, spec: AttentionSpec, scale: float) -> torch.Tensor:
        backend = self.cuda_backend() if query.is_cuda else self.torch_backend
        return backend.forward(query, key, value, kv_cache, meta, spec, scale)
