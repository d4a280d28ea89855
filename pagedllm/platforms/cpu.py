"""The CPU: the C++ kernels (float32; the encoder's also bfloat16), oneDNN's bf16 matmul where the CPU has
native bf16, xgrammar's C++ bitmask loop, KV memory written whole at start-up (or mapped lazily)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from pagedllm import envs
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.logger import init_logger
from pagedllm.platforms.interface import Platform
from pagedllm.utils import physical_cpu_cores

logger = init_logger(__name__)


class CpuPlatform(Platform):
    name = "cpu"
    reuses_logits_buffer = True
    maps_kv_lazily = True

    def _make_attention_backend(self, name: str) -> Any:
        from pagedllm.attention.backends.cpu_paged import CpuPagedAttentionBackend

        if name == "cpu" or (name == "auto" and load_cpu_kernels() is not None):
            return CpuPagedAttentionBackend()
        return super()._make_attention_backend(name)

    def prepare_worker(self) -> None:
        # One thread per physical core; more only adds contention on small matmuls.
        if envs.OMP_NUM_THREADS is None:
            torch.set_num_threads(max(1, physical_cpu_cores()))
        # Build/load the C++ kernels now, so a fresh machine compiles them during start-up (logged)
        # and not inside the first request, after the server already reported healthy.
        load_cpu_kernels()

    def cpu_kernels(self, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> Any | None:
        # Asked by every layer on every step: no import or lookup beyond the cached loader here.
        return load_cpu_kernels() if dtype in dtypes else None

    def elementwise_kernels(self, dtype: torch.dtype) -> Any | None:
        # bf16: the fused passes round where the torch ops do (kernels/csrc/fused_ops.cpp), so results match.
        return self.cpu_kernels(dtype, (torch.float32, torch.bfloat16))

    def layer_norm_kernels(self, dtype: torch.dtype) -> Any | None:
        # One pass for the residual add and the norm: torch's bf16 add and LayerNorm over Whisper's 1,500 x 512
        # encoder rows took ~190 and ~235 us. The CPU kernels themselves (not elementwise_kernels, which tests
        # swap for Triton's ops, which have no LayerNorm).
        return self.cpu_kernels(dtype, (torch.float32, torch.bfloat16))

    def activation_kernels(self, dtype: torch.dtype) -> Any | None:
        # bf16 too: one pass that rounds as torch's SiLU and multiply do (200 x 1,536 gated rows 117 vs 126 us,
        # 2,048 rows 1.4 vs 1.7-3.8 ms on an AMD Zen 4).
        return self.cpu_kernels(dtype, (torch.float32, torch.bfloat16))

    def step_graph_kernels(self, dtype: torch.dtype) -> Any | None:
        # bf16 too: where the kernel autotuner gives a matmul to oneDNN (a torch op; AMX on a Xeon), the capture
        # refuses that batch size and the ones above it, which then run eagerly (worker/cpu_graphs.py).
        return self.cpu_kernels(dtype, (torch.float32, torch.bfloat16))

    def rotary_kernels(self, dtype: torch.dtype, table_dtype: torch.dtype) -> Any | None:
        return self.elementwise_kernels(dtype) if table_dtype == dtype else None

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        # The C++ kernels read float32 or bf16 K/V under float32 or bf16 queries, and write_kv rounds float32
        # K/V into a bf16 cache; the portable path casts what it gathers.
        both = (torch.float32, torch.bfloat16)
        return (model_dtype, *(d for d in both if d != model_dtype)) if model_dtype in both else (model_dtype,)

    def onednn_bf16(self) -> bool:
        from pagedllm.model_executor.layers.quantization.unquantized import onednn_bf16_available

        return onednn_bf16_available()

    def grammar_bitmask_apply(self, dtype: torch.dtype) -> Callable[..., None] | None:
        # xgrammar's C++ loop: ~4x faster than unpacking the bits with torch ops on a CPU.
        return _xgrammar_apply() if dtype == torch.float32 else None

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              prefault: bool = False) -> torch.Tensor:
        from pagedllm.worker.cpu_memory import zeroed_host_tensor

        # Its own mapping: written whole now on huge pages (prefault), or backed lazily as blocks are used.
        return zeroed_host_tensor(shape, dtype, prefault=prefault)

    def prepare_kv_for_transfer(self, kv_caches: list[torch.Tensor]) -> None:
        from pagedllm.worker.cpu_memory import advise_huge_pages

        # Another instance reads these blocks with process_vm_readv, ~1.5x faster from huge pages.
        advised = sum(advise_huge_pages(cache) for cache in kv_caches)
        logger.info("KV cache on transparent huge pages for transfers: %d of %d layers", advised, len(kv_caches))


@functools.cache
def _xgrammar_apply() -> Callable[..., None] | None:
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        return None
    return apply_token_bitmask_inplace
