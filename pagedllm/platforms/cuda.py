"""NVIDIA GPUs: the Triton kernels (element-wise ops, quantized matmuls by rows), CUDA graphs, host copies
through pinned memory so they queue without a stream sync (a blocking copy waits for every queued kernel)."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.platforms.interface import Platform
from pagedllm.platforms.kernel_families import kernel_module


class CudaPlatform(Platform):
    name = "cuda"
    is_accelerator = True
    supports_graphs = True
    packs_quantized_by_rows = True
    distributed_backend = "nccl"

    def attention_backend_choices(self, requested: str = "auto") -> tuple[str, ...]:
        # The Triton kernel where triton is installed, else the portable path.
        if requested == "auto":
            return ("triton", "torch")
        return ("triton",) if requested == "triton" else super().attention_backend_choices(requested)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        # The Triton kernel reads fp8 rows, widened in registers: Triton converts fp8 natively from sm_89 on, so
        # an older GPU keeps its model's dtype (an fp8 request is refused at start-up, not at the first step).
        if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
            return (model_dtype, torch.float8_e4m3fn, torch.float8_e5m2)
        return (model_dtype,)

    def max_tensor_parallel_size(self) -> int:
        return torch.cuda.device_count()

    def rank_device(self, device: torch.device, rank: int) -> torch.device:
        # One GPU per rank: NCCL and the caching allocator use the current one. A Ray actor sees only its own GPU.
        index = rank if torch.cuda.device_count() > rank else 0
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def elementwise_family(self, dtype: torch.dtype) -> str | None:
        return "triton"

    def fused_norm_keeps_offset_exact(self, dtype: torch.dtype) -> bool:
        # The fused Triton RMSNorm takes the scale in the activation dtype: Gemma's 1 + w would round to bf16 first.
        return False

    def activation_family(self, dtype: torch.dtype) -> str | None:
        return "triton"

    def rotary_family(self, dtype: torch.dtype, table_dtype: torch.dtype) -> str | None:
        return "triton"

    def runs_triton(self) -> bool:
        return kernel_module("triton") is not None

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if t.device.type != "cpu":
            return t.to(device)
        return t.pin_memory().to(device, non_blocking=True)

    def tensor_on(self, values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.mem_get_info(device)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)
