"""The CPU: the C++ kernels (float32; the encoder's also bfloat16), oneDNN's bf16 matmul where the CPU has
native bf16, xgrammar's C++ bitmask loop, KV memory written whole at start-up (or mapped lazily)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from pagedllm import envs
from pagedllm.logger import init_logger
from pagedllm.platforms import cpu_probes
from pagedllm.platforms.cpu_memory import advise_huge_pages, zeroed_host_tensor
from pagedllm.platforms.interface import Platform
from pagedllm.platforms.kernel_families import kernel_module
from pagedllm.utils import physical_cpu_cores

logger = init_logger(__name__)

# The dtypes the C++ element-wise, norm, activation and step-graph kernels take.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class CpuPlatform(Platform):
    name = "cpu"
    reuses_logits_buffer = True
    maps_kv_lazily = True
    native_kernels = "cpu"

    def attention_backend_choices(self, requested: str = "auto") -> tuple[str, ...]:
        # The C++ kernels where they were built, else the portable path.
        if requested == "auto":
            return ("cpu", "torch")
        return ("cpu",) if requested == "cpu" else super().attention_backend_choices(requested)

    def prepare_worker(self) -> None:
        # One thread per physical core; more only adds contention on small matmuls.
        if envs.OMP_NUM_THREADS is None:
            torch.set_num_threads(max(1, physical_cpu_cores()))
        # Build/load the C++ kernels now, so a fresh machine compiles them during start-up (logged)
        # and not inside the first request, after the server already reported healthy.
        kernel_module(self.native_kernels)

    def elementwise_family(self, dtype: torch.dtype) -> str | None:
        # bf16: the fused passes round where the torch ops do (kernels/csrc/fused_ops.cpp), so results match.
        return "cpu" if dtype in _KERNEL_DTYPES else None

    def layer_norm_family(self, dtype: torch.dtype) -> str | None:
        # One pass for the residual add and the norm, where torch's bf16 add and LayerNorm over Whisper's encoder
        # rows take two, each of a noticeable cost (docs/performance.md). The CPU kernels themselves (not
        # elementwise_family's, which tests swap for Triton's ops, which have no LayerNorm).
        return "cpu" if dtype in _KERNEL_DTYPES else None

    def activation_family(self, dtype: torch.dtype) -> str | None:
        # bf16 too: one pass that rounds as torch's SiLU and multiply do, and is faster than them
        # (docs/performance.md).
        return "cpu" if dtype in _KERNEL_DTYPES else None

    def step_graph_family(self, dtype: torch.dtype) -> str | None:
        # bf16 too: where the kernel autotuner gives a matmul to oneDNN (a torch op; AMX on a Xeon), the capture
        # refuses that batch size and the ones above it, which then run eagerly (worker/cpu_graphs.py).
        return "cpu" if dtype in _KERNEL_DTYPES else None

    def rotary_family(self, dtype: torch.dtype, table_dtype: torch.dtype) -> str | None:
        return self.elementwise_family(dtype) if table_dtype == dtype else None

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        # The C++ kernels read float32, bf16 or fp8 K/V under float32 or bf16 queries, and write_kv rounds float32
        # K/V into a bf16 or fp8 cache; the portable path casts what it gathers.
        both = (torch.float32, torch.bfloat16)
        if model_dtype not in both:
            return (model_dtype,)
        return (model_dtype, *(d for d in both if d != model_dtype), torch.float8_e4m3fn, torch.float8_e5m2)

    def onednn_bf16(self) -> bool:
        return cpu_probes.onednn_bf16_available()

    def grammar_bitmask_apply(self, dtype: torch.dtype) -> Callable[..., None] | None:
        # xgrammar's C++ loop: several times faster than unpacking the bits with torch ops on a CPU
        # (docs/performance.md).
        return _xgrammar_apply() if dtype == torch.float32 else None

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              prefault: bool = False) -> torch.Tensor:
        # Its own mapping: written whole now on huge pages (prefault), or backed lazily as blocks are used.
        return zeroed_host_tensor(shape, dtype, prefault=prefault)

    def prepare_kv_for_transfer(self, kv_caches: list[torch.Tensor]) -> None:
        # Another instance reads these blocks with process_vm_readv, faster from huge pages (advise_huge_pages).
        advised = sum(advise_huge_pages(cache) for cache in kv_caches)
        logger.info("KV cache on transparent huge pages for transfers: %d of %d layers", advised, len(kv_caches))


@functools.cache
def _xgrammar_apply() -> Callable[..., None] | None:
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        return None
    return apply_token_bitmask_inplace
