"""NVIDIA GPUs: the Triton kernels (element-wise ops, quantized matmuls by rows), CUDA graphs, host copies
through pinned memory so they queue without a stream sync (a blocking copy waits for every queued kernel)."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    is_accelerator = True
    supports_graphs = True
    packs_quantized_by_rows = True
    distributed_backend = "nccl"

    def max_tensor_parallel_size(self) -> int:
        return torch.cuda.device_count()

    def rank_device(self, device: torch.device, rank: int) -> torch.device:
        # One GPU per rank: NCCL and the caching allocator use the current one. A Ray actor sees only its own GPU.
        index = rank if torch.cuda.device_count() > rank else 0
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def _make_attention_backend(self, name: str) -> Any:
        from pagedllm.kernels import triton_ops

        if name == "triton" or (name == "auto" and triton_ops.triton_available()):
            from pagedllm.attention.backends.triton_paged import TritonPagedAttentionBackend

            if not triton_ops.triton_available():
                raise ValueError("attention_backend: 'triton' needs triton, which is not installed")
            return TritonPagedAttentionBackend(super()._make_attention_backend("torch"))
        return super()._make_attention_backend(name)

    def elementwise_kernels(self, dtype: torch.dtype) -> Any | None:
        from pagedllm.kernels import triton_ops

        return triton_ops.TRITON_OPS if triton_ops.triton_available() else None

    def fused_norm_keeps_offset_exact(self, dtype: torch.dtype) -> bool:
        # The fused Triton RMSNorm takes the scale in the activation dtype: Gemma's 1 + w would round to bf16 first.
        return False

    def activation_kernels(self, dtype: torch.dtype) -> Any | None:
        return self.elementwise_kernels(dtype)

    def rotary_kernels(self, dtype: torch.dtype, table_dtype: torch.dtype) -> Any | None:
        return self.elementwise_kernels(dtype)

    def runs_triton(self) -> bool:
        from pagedllm.kernels import triton_ops

        return triton_ops.triton_available()

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if t.device.type != "cpu":
            return t.to(device)
        return t.pin_memory().to(device, non_blocking=True)

    def tensor_on(self, values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
