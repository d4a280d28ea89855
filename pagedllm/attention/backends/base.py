"""The attention backend interface: one class per way of attending (portable torch, CPU kernel, CUDA ...).

Every backend reads the same ``AttentionMetadata`` (constructed only in ``attention/metadata.py``) and is told
each layer's ``AttentionSpec``; a backend that cannot serve a spec falls back to the portable one inside its
``forward``.

Per-step state. What a backend derives from a step's metadata once and every layer reuses (the torch and CPU
backends' plan of the batch, the encoder's buckets) lives in ``meta.backend_state[backend.state_key]``. The
model runner has it built once per eagerly run step, right after it builds the metadata: ``prepare_step``
for each backend its layers are bound to, with the specs of the layers that read that metadata
(``model_executor.layers.attention.prepare_step_states``); ``build_state`` makes it. Metadata that a caller
builds and runs itself (tests, the draft model, Whisper's encoder, the GPU profiling step) gets each piece from
the first layer that asks, through the same functions.

Graphs. ``graph_safe``: the forward reads no tensor value on the host, so a step can be captured as a CUDA
graph; ``records_step_graphs``: the forward of a decode step is nothing but calls of the C++ kernels, which a CPU
step graph records (``worker/cpu_graphs.py``). The graph runners need nothing more from a backend: a capture is
an ordinary forward over the buffers' metadata (its state built there, from host lists that describe shapes
only: decodes, one token each), and a replay repeats the captured kernels without calling the backend, so the
runner prepares no state for a replayed step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any

import torch

from pagedllm.attention.backends.paged_kv import write_kv
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec


class AttentionBackend(ABC):
    name: str = "abstract"
    #: Reads no tensor values on the host, so a step through it can be captured as a CUDA graph.
    graph_safe: bool = False
    #: A decode step's forward through it is only C++ kernel calls, so a CPU step graph can record it.
    records_step_graphs: bool = False
    #: The key of this backend's per-step state in ``meta.backend_state``; None: it keeps none.
    state_key: str | None = None

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata, spec: AttentionSpec, scale: float) -> torch.Tensor:
        """query: [T, H, D]; key/value: [T, Hkv, D] (this step's new tokens) -> output [T, H, D].

        ``kv_cache`` ([2, num_blocks, block_size, Hkv, D]) receives this step's K/V by ``meta.slot_mapping``
        before any request reads it; it is None for encoder layers, which keep no cache. key/value None
        (only where ``takes_kv_from_rotary`` said yes): the step's K/V is in the cache already.
        """

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store K/V computed outside a forward (an encoder's output for cross-attention) by slot.
        key/value: [T, Hkv, D] (token rows may be strided); slot_mapping: [T] int64."""
        write_kv(kv_cache, key, value, slot_mapping)

    def takes_kv_from_rotary(self, qkv: torch.Tensor) -> bool:
        """Whether, for tensors like ``qkv``, this backend lets the rotary kernel write the step's K/V into the
        cache (``triton_ops.rotary_and_write_kv_``) and then attends with key = value = None."""
        return False

    def build_state(self, meta: AttentionMetadata, specs: Collection[AttentionSpec]) -> Any:
        """This backend's state for ``meta``'s step, for layers of ``specs`` reading it (only what they will
        use); None: nothing to keep."""
        return None

    def prepare_step(self, meta: AttentionMetadata, specs: Collection[AttentionSpec]) -> None:
        """Build this step's state once, before the forward, and keep it under ``state_key``."""
        if self.state_key is None:
            return
        state = self.build_state(meta, specs)
        if state is not None:
            meta.backend_state[self.state_key] = state
