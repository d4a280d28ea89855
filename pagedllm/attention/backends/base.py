"""The attention backend interface: one class per way of attending (portable torch, CPU kernel, CUDA ...).

Every backend reads the same ``AttentionMetadata`` (constructed only in ``attention/metadata.py``) and is told
each layer's ``AttentionSpec``; a backend that cannot serve a spec falls back to the portable one inside its
``forward``.

Per-step state. What a backend derives from a step's metadata once and every layer reuses (the torch and CPU
backends' plan of the batch, the encoder's buckets) is an object of its ``state_type``, kept in
``meta.backend_state`` under that class and read with ``meta.step_state(state_type)``. ``prepare_step`` builds it
(``build_state``), once per step and before the forward, for the specs of the layers that will read that
metadata. Everything that builds metadata and runs layers over it goes through it the same way
(``model_executor.layers.attention``: ``step_readers`` + ``prepare_step_states``, or ``attention_step``): the
model runner and the pooling runner for each eagerly run step, the GPU profiling step, the draft model, Whisper's
encoder, the graph captures, the tests. A forward never builds state: over metadata nobody prepared it raises.

Graphs. ``graph_safe``: the forward reads no tensor value on the host, so a step can be captured as a CUDA
graph; ``records_step_graphs``: the forward of a decode step is nothing but calls of the C++ kernels, which a CPU
step graph records (``worker/cpu_graphs.py``). The graph runners need nothing more from a backend: a capture is
an ordinary forward over the buffers' metadata, prepared like any other (from host lists that describe shapes
only: requests of ``query_len`` tokens each), and a replay repeats the captured kernels without calling the
backend, so the runner prepares no state for a replayed step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection

import torch

from pagedllm.attention.backends.paged_kv import write_kv
from pagedllm.attention.key_rotation import KeyRotation, rotate_heads_
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec


class AttentionBackend(ABC):
    name: str = "abstract"
    #: Reads no tensor values on the host, so a step through it can be captured as a CUDA graph.
    graph_safe: bool = False
    #: A decode step's forward through it is only C++ kernel calls, so a CPU step graph can record it.
    records_step_graphs: bool = False
    #: The class of this backend's per-step state (its key in ``meta.backend_state``); None: it keeps none.
    state_type: type | None = None

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata, spec: AttentionSpec, scale: float,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query: [T, H, D]; key/value: [T, Hkv, D] (this step's new tokens) -> output [T, H, D].

        ``kv_cache`` ([2, num_blocks, block_size, Hkv, D]) receives this step's K/V by ``meta.slot_mapping``
        before any request reads it; it is None for encoder layers, which keep no cache. key/value None
        (only where ``takes_kv_from_rotary`` said yes): the step's K/V is in the cache already.
        ``kv_scale``: [2] float32 (k_scale, v_scale) of an fp8 cache (``paged_kv``), on the cache's device; None
        or ignored for other caches.
        """

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        """Store K/V computed outside a forward (an encoder's output for cross-attention) by slot.
        key/value: [T, Hkv, D] (token rows may be strided); slot_mapping: [T] int64."""
        write_kv(kv_cache, key, value, slot_mapping, kv_scale)

    def rotate_heads_(self, x: torch.Tensor, rotation: KeyRotation, which: str) -> None:
        """In place: x [T, H, D] (queries or keys of a layer whose fp8 cache keeps keys rotated; rows and heads
        may be strided) <- x @ ``rotation``'s ``which`` ("query" / "key") matrix."""
        rotate_heads_(x, rotation, which)

    def takes_kv_from_rotary(self, qkv: torch.Tensor) -> bool:
        """Whether, for tensors like ``qkv``, this backend lets the rotary kernel write the step's K/V into the
        cache (``triton_ops.rotary_and_write_kv_``) and then attends with key = value = None."""
        return False

    def build_state(self, meta: AttentionMetadata, specs: Collection[AttentionSpec]) -> object | None:
        """This backend's state (a ``state_type``) for ``meta``'s step, for layers of ``specs`` reading it (only
        what they will use); None: nothing to keep."""
        return None

    def prepare_step(self, meta: AttentionMetadata, specs: Collection[AttentionSpec]) -> None:
        """Build this step's state once, before the forward, and keep it under ``state_type``."""
        if self.state_type is None:
            return
        state = self.build_state(meta, specs)
        if state is not None:
            meta.backend_state[self.state_type] = state
