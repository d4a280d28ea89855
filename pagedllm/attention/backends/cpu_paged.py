"""The CPU backend: ``TorchPagedAttentionBackend`` with the C++ kernels where they apply. The paged kernel
serves decodes and chunks with earlier context of up to ``CONTEXT_CHUNK_KERNEL_MAX_LEN`` tokens (later prefill
chunks, prefix hits) and fresh prompts of up to ``FRESH_PROMPT_KERNEL_MAX_LEN`` (shorter limits for bf16 queries:
``kernel_limits``), reading K/V through the block tables in place, and stores every K/V (``write_kv``); the
encoder kernel attends each (sequence, head) of an encoder layer in place. What they do not take (longer chunks
and prompts, the sliding window's long steps) goes through the portable torch path."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend
from pagedllm.kernels.cpu import load_cpu_kernels


class CpuPagedAttentionBackend(TorchPagedAttentionBackend):
    name = "cpu"
    records_step_graphs = True

    def __init__(self) -> None:
        kernels = load_cpu_kernels()
        if kernels is None:
            raise ValueError("attention_backend: 'cpu' needs the C++ CPU kernels, which could not be built or "
                             "loaded here (see the warning above); use 'torch'")
        self.kernels = kernels

    def _kernels(self, tensor: torch.Tensor) -> Any | None:
        return self.kernels
