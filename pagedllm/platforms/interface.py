"""What a platform decides: the kernels that serve a tensor, how memory is made and copied, what the engine
can overlap. The base class is the portable answer (plain torch everywhere); ``CpuPlatform`` and
``CudaPlatform`` override what their kernels do better."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.config import ATTENTION_BACKENDS


class Platform:
    """Plain torch on any device: no C++ or Triton kernels, no overlap, nothing captured."""

    name = "portable"
    #: Host and device are separate processors: the host prepares step N + 1 (outputs, grammar bitmasks) while
    #: the device computes step N, and the KV cache budget is measured from the device's free memory.
    is_accelerator = False
    #: Decode steps can be captured once and replayed as graphs.
    supports_graphs = False
    #: Quantized weights are packed by rows for the Triton kernels (``QRows``), not in the CPU kernels' panels.
    packs_quantized_by_rows = False
    #: The runner keeps one logits buffer across steps (a fresh vocab-sized tensor per step costs page faults).
    reuses_logits_buffer = False
    #: The KV cache's pages are mapped on first write unless pre-faulted (``zeros(..., prefault=True)``).
    maps_kv_lazily = False
    #: torch.distributed backend of the tensor-parallel group (``distributed/parallel_state.py``).
    distributed_backend = "gloo"

    def __init__(self) -> None:
        self._attention_backends: dict[str, Any] = {}

    def attention_backend(self, name: str = "auto") -> Any:
        """The attention backend ``name`` (one of ``ATTENTION_BACKENDS``) on this platform, made once."""
        if name not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
        backend = self._attention_backends.get(name)
        if backend is None:
            backend = self._attention_backends[name] = self._make_attention_backend(name)
        return backend

    def _make_attention_backend(self, name: str) -> Any:
        from pagedllm.attention.backends.torch_sdpa import TorchPagedAttentionBackend

        if name in ("auto", "torch"):
            return TorchPagedAttentionBackend()
        raise ValueError(f"attention_backend: {name!r} does not run on the {self.name} platform; use torch")

    def max_tensor_parallel_size(self) -> int:
        """The most tensor-parallel ranks this host can give distinct processors: one physical core each here."""
        from pagedllm.utils import physical_cpu_cores

        return max(1, physical_cpu_cores())

    def rank_device(self, device: torch.device, rank: int) -> torch.device:
        """The device tensor-parallel rank ``rank`` computes on (one host processor set: the same device)."""
        return device

    def prepare_worker(self) -> None:
        """Once, when a worker starts on this platform (thread pools, kernels compiled before the first request)."""

    def cpu_kernels(self, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> Any | None:
        """The C++ kernels module for tensors of ``dtype`` (one of ``dtypes``, the ones the caller's kernels
        take) on this platform, or None."""
        return None

    def elementwise_kernels(self, dtype: torch.dtype) -> Any | None:
        """A module with ``rms_norm_`` and ``rotary_`` for tensors of ``dtype``, or None."""
        return None

    def layer_norm_kernels(self, dtype: torch.dtype) -> Any | None:
        """A module with ``layer_norm`` and ``layer_norm_`` (the residual add fused) for tensors of ``dtype``, or
        None."""
        return None

    def fused_norm_keeps_offset_exact(self, dtype: torch.dtype) -> bool:
        """Whether the fused RMSNorm gives Gemma's ``1 + w`` scale as the reference does (in float32) for
        activations of ``dtype``: it takes the scale in that dtype, which is exact in float32 only."""
        return dtype == torch.float32

    def step_graph_kernels(self, dtype: torch.dtype) -> Any | None:
        """The C++ kernels module that records and replays decode steps of a model in ``dtype`` (CPU step graphs,
        ``worker/cpu_graphs.py``), or None where steps are not recorded that way."""
        return None

    def activation_kernels(self, dtype: torch.dtype) -> Any | None:
        """A module with ``silu_and_mul`` for tensors of ``dtype``, or None."""
        return None

    def rotary_kernels(self, dtype: torch.dtype, table_dtype: torch.dtype) -> Any | None:
        """The in-place ``rotary_`` for activations of ``dtype`` and a cos/sin table of ``table_dtype``, or None."""
        return None

    def runs_triton(self) -> bool:
        """Whether the Triton kernels run for tensors here (on a GPU, or in Triton's interpreter)."""
        from pagedllm.kernels import triton_ops

        return triton_ops.triton_available() and triton_ops.interpreted()

    def onednn_bf16(self) -> bool:
        """Whether bfloat16 weights are prepacked for oneDNN's fused matmul here."""
        return False

    def packs_linear_weights(self, dtype: torch.dtype) -> bool:
        """Whether unquantized linear layers keep their weights of ``dtype`` repacked here (C++ panels, oneDNN's
        blocked layout): where they do, a tied LM head pays for a copy of its own instead of the embedding rows."""
        return self.cpu_kernels(dtype) is not None or (dtype == torch.bfloat16 and self.onednn_bf16())

    def grammar_bitmask_apply(self, dtype: torch.dtype) -> Callable[..., None] | None:
        """xgrammar's in-place bitmask apply for logits of ``dtype`` here, or None (torch ops then)."""
        return None

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The dtypes the KV cache may keep here under a model of ``model_dtype`` (its own always)."""
        return (model_dtype,)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              prefault: bool = False) -> torch.Tensor:
        """A zeroed tensor for the KV cache; ``prefault``: resident from now on, where memory is mapped lazily."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def prepare_kv_for_transfer(self, kv_caches: list[torch.Tensor]) -> None:
        """Before a KV connector registers the cache: whatever makes other processes' reads of it cheaper."""

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` on ``device`` (of this platform)."""
        return t.to(device)

    def tensor_on(self, values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``torch.tensor(values, dtype=dtype)`` on ``device`` (of this platform)."""
        return torch.tensor(values, dtype=dtype, device=device)
