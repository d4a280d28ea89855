"""What a platform decides: which attention backend and kernel family serve a tensor (by name: the registries
above resolve them, ``attention/backends/registry.py`` and ``kernels/registry.py``), how memory is made and
copied, what the engine can overlap. The base class is the portable answer (plain torch everywhere);
``CpuPlatform`` and ``CudaPlatform`` override what their kernels do better."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.config import ATTENTION_BACKENDS
from pagedllm.platforms.kernel_families import kernel_module


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
    #: The kernel family of the C++ kernels on this platform's tensors (``cpu_kernels``), or None.
    native_kernels: str | None = None

    def attention_backend_choices(self, requested: str = "auto") -> tuple[str, ...]:
        """The attention backends that may serve ``requested`` (one of ``ATTENTION_BACKENDS``) here, best first.

        "auto" lists this platform's preferences, and the registry (``attention/backends/registry.py``) takes the
        first whose kernels are available; a named backend lists itself. ValueError where it does not run here.
        """
        if requested not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}")
        if requested in ("auto", "torch"):
            return ("torch",)
        raise ValueError(f"attention_backend: {requested!r} does not run on the {self.name} platform; use torch")

    def is_available(self) -> bool:
        """Whether this process can compute on this platform's device (a GPU the driver shows, say)."""
        return True

    def max_tensor_parallel_size(self) -> int:
        """The most tensor-parallel ranks this host can give distinct processors: one physical core each here."""
        from pagedllm.utils import physical_cpu_cores

        return max(1, physical_cpu_cores())

    def rank_device(self, device: torch.device, rank: int) -> torch.device:
        """The device tensor-parallel rank ``rank`` computes on (one host processor set: the same device)."""
        return device

    def prepare_worker(self) -> None:
        """Once, when a worker starts on this platform (thread pools, kernels compiled before the first request)."""

    # Kernel families by op: the name ("cpu", "triton") of the family that serves the op for tensors of a dtype
    # here, or None (torch ops). Subclasses answer these; the ``*_kernels`` methods below resolve them.

    def elementwise_family(self, dtype: torch.dtype) -> str | None:
        """The family whose ``rms_norm`` / ``rms_norm_`` serve tensors of ``dtype``, or None."""
        return None

    def layer_norm_family(self, dtype: torch.dtype) -> str | None:
        """The family whose ``layer_norm`` / ``layer_norm_`` (the residual add fused) serve ``dtype``, or None."""
        return None

    def activation_family(self, dtype: torch.dtype) -> str | None:
        """The family whose ``silu_and_mul`` serves tensors of ``dtype``, or None."""
        return None

    def rotary_family(self, dtype: torch.dtype, table_dtype: torch.dtype) -> str | None:
        """The family whose in-place ``rotary_`` serves activations of ``dtype`` with a cos/sin table of
        ``table_dtype``, or None."""
        return None

    def step_graph_family(self, dtype: torch.dtype) -> str | None:
        """The family that records and replays decode steps of a model in ``dtype`` (CPU step graphs,
        ``worker/cpu_graphs.py``), or None where steps are not recorded that way."""
        return None

    def cpu_kernels_family(self, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> str | None:
        """The family of the C++ kernels for tensors of ``dtype`` (one of ``dtypes``, the ones the caller's kernels
        take) on this platform, or None."""
        return self.native_kernels if dtype in dtypes else None

    # The modules of those families, for callers that ask per use rather than bind once (the sampler, the
    # packed weights, the worker): resolved through the loaders the kernels layer registered.

    def cpu_kernels(self, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> Any | None:
        """The module of ``cpu_kernels_family(dtype, dtypes)``, or None."""
        return kernel_module(self.cpu_kernels_family(dtype, dtypes))

    def elementwise_kernels(self, dtype: torch.dtype) -> Any | None:
        """The module of ``elementwise_family(dtype)``, or None."""
        return kernel_module(self.elementwise_family(dtype))

    def layer_norm_kernels(self, dtype: torch.dtype) -> Any | None:
        """The module of ``layer_norm_family(dtype)``, or None."""
        return kernel_module(self.layer_norm_family(dtype))

    def activation_kernels(self, dtype: torch.dtype) -> Any | None:
        """The module of ``activation_family(dtype)``, or None."""
        return kernel_module(self.activation_family(dtype))

    def rotary_kernels(self, dtype: torch.dtype, table_dtype: torch.dtype) -> Any | None:
        """The module of ``rotary_family(dtype, table_dtype)``, or None."""
        return kernel_module(self.rotary_family(dtype, table_dtype))

    def step_graph_kernels(self, dtype: torch.dtype) -> Any | None:
        """The module of ``step_graph_family(dtype)``, or None."""
        return kernel_module(self.step_graph_family(dtype))

    def fused_norm_keeps_offset_exact(self, dtype: torch.dtype) -> bool:
        """Whether the fused RMSNorm gives Gemma's ``1 + w`` scale as the reference does (in float32) for
        activations of ``dtype``: it takes the scale in that dtype, which is exact in float32 only."""
        return dtype == torch.float32

    def runs_triton(self) -> bool:
        """Whether the Triton kernels run for tensors here (on a GPU, or in Triton's interpreter)."""
        return kernel_module("triton-interpreter") is not None  # off a GPU, only interpreted

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

    # Device memory, for sizing the KV cache from what a profiled step leaves free (accelerators only: a host
    # processor's cache is sized by --kv-cache-memory). Named as torch.cuda's, which CUDA answers with.

    def empty_cache(self) -> None:
        """Hand the allocator's cached, unused blocks back to the device."""

    def synchronize(self, device: torch.device) -> None:
        """Wait until every kernel queued on ``device`` has run."""

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes of ``device``'s memory."""
        raise NotImplementedError(f"the {self.name} platform does not measure device memory")

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """Start ``max_memory_allocated`` over from what is allocated now."""

    def memory_allocated(self, device: torch.device) -> int:
        """Bytes of ``device``'s memory that tensors hold now."""
        raise NotImplementedError(f"the {self.name} platform does not measure device memory")

    def max_memory_allocated(self, device: torch.device) -> int:
        """The most bytes tensors held on ``device`` since ``reset_peak_memory_stats``."""
        raise NotImplementedError(f"the {self.name} platform does not measure device memory")
