"""The attention layer models use: projections are the model's, paging is ours."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.backends.bidirectional_runs import attend_bidirectional_runs
from pagedllm.attention.backends.paged_kv import is_fp8
from pagedllm.attention.backends.selector import DeviceAttentionBackend
from pagedllm.attention.backends.torch_sinks import sink_attention
from pagedllm.attention.forward_context import forward_context, get_attn_metadata
from pagedllm.attention.key_rotation import KeyRotation
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.kv_cache_scales import calculate_kv_scale_

_DEFAULT_BACKEND = DeviceAttentionBackend()


class Attention(DirectCall, nn.Module):
    """Paged multi-head / grouped-query attention over the KV cache bound to this layer.

    ``spec`` says what the layer attends to (causal, sliding window, encoder). The model runner binds
    ``kv_cache`` ([2, num_blocks, block_size, Hkv, D]) after allocating it; encoder layers keep none.
    ``sinks``: a learned logit per head in the softmax's denominator (gpt-oss; ``num_heads`` of them, loaded by the
    model): such a layer attends through ``torch_sinks`` whatever its backend is.
    ``kv_scale`` ([2] float32: k_scale, v_scale, on the cache's device): what an fp8 cache divides this layer's K/V
    by (1.0 unless the checkpoint ships k_scale / v_scale or --calculate-kv-scales sets them; ``kv_cache_scales``).
    ``key_rotation`` (``attention.key_rotation``): an fp8 cache whose scales are not the checkpoint's keeps keys
    turned by it, and queries are turned alike (every score unchanged, the keys' rounding spread over the head);
    None otherwise (set by ``bind_kv_caches``).
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 layer_idx: int = 0, spec: AttentionSpec | None = None,
                 backend: AttentionBackend | None = None, sinks: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.layer_idx = layer_idx
        self.spec = spec or AttentionSpec.causal()
        self.backend = backend or _DEFAULT_BACKEND
        self.kv_cache: torch.Tensor | None = None
        self.kv_group = 0  # the KV cache group whose block tables index kv_cache (set by bind_kv_caches)
        self.sinks: nn.Parameter | None = None
        if sinks:
            if not self.spec.uses_kv_cache or self.spec.kind == "cross":
                raise ValueError("attention sinks are implemented for causal and sliding-window layers only")
            self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False)
        # Not a parameter (set in place, never trained); on the host until bind_kv_caches moves it to the cache.
        self.kv_scale = torch.ones(2, dtype=torch.float32, device="cpu")
        self.calculate_kv_scales = False  # set by the model runner for its first step (--calculate-kv-scales)
        self.kv_scales_from_checkpoint = False  # set by kv_cache_scales.load_kv_scale
        self.key_rotation: KeyRotation | None = None

    def rotate_for_cache(self, query: torch.Tensor, key: torch.Tensor | None) -> None:
        """In place: query [T, H, D] and key [T, Hkv, D] (or None; rows and heads may be strided, e.g. views of
        the fused qkv output) turned into the basis this layer's cache keeps keys in (``key_rotation``), when it
        is set; else left as they are."""
        if self.key_rotation is None:
            return
        self.backend.rotate_heads_(query, self.key_rotation, "query")
        if key is not None:
            self.backend.rotate_heads_(key, self.key_rotation, "key")

    def maybe_calculate_kv_scales(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """With ``calculate_kv_scales`` set (--calculate-kv-scales, the first step), set ``kv_scale`` from this
        step's key / value ([T, Hkv*D] or [T, Hkv, D]) and clear it."""
        if self.calculate_kv_scales:
            calculate_kv_scale_(self.kv_scale, key, value)
            self.calculate_kv_scales = False

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor:
        """query: [T, H*D], key/value: [T, Hkv*D] -> [T, H*D]. key = value = None: this step's K/V is in
        the cache already (``write_kv_with_rotary``). With ``key_rotation`` set, query and key are turned in place
        (the caller's tensors: a model reads neither after its attention)."""
        if self.kv_cache is None and self.spec.uses_kv_cache:
            raise RuntimeError(f"no KV cache bound to attention layer {self.layer_idx}")
        t = query.shape[0]
        q = query.view(t, self.num_heads, self.head_size)
        k = None if key is None else key.view(t, self.num_kv_heads, self.head_size)
        self.rotate_for_cache(q, k)
        v = None if value is None else value.view(t, self.num_kv_heads, self.head_size)
        if k is not None:
            self.maybe_calculate_kv_scales(k, v)
        meta = get_attn_metadata(self.kv_group)
        if self.sinks is not None:
            out = sink_attention(q, k, v, self.kv_cache, meta, self.scale, self.sinks,
                                 self.spec.window_for(meta.max_seq_len))
            return out.view(t, self.num_heads * self.head_size)
        out = self.backend.forward(q, k, v, self.kv_cache, meta, self.spec, self.scale, self.kv_scale)
        if meta.bidirectional_runs and self.spec.kind in ("causal", "sliding"):
            attend_bidirectional_runs(q, out, self.kv_cache, meta, self.scale, self.spec.window_for(meta.max_seq_len),
                                      self.kv_scale)
        return out.view(t, self.num_heads * self.head_size)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store K/V computed outside a forward (cross-attention's, from the encoder) into this layer's cache.
        key/value: [T, Hkv*D] or [T, Hkv, D] (token rows may be strided); slot_mapping: [T] int64."""
        if self.kv_cache is None:
            raise RuntimeError(f"no KV cache bound to attention layer {self.layer_idx}")
        t = key.shape[0]
        k = key.view(t, self.num_kv_heads, self.head_size)
        if self.key_rotation is not None:
            k = k.clone()  # the caller's K stays as it is
            self.backend.rotate_heads_(k, self.key_rotation, "key")
        self.backend.write_kv(self.kv_cache, k, value.view(t, self.num_kv_heads, self.head_size), slot_mapping,
                              self.kv_scale)

    def write_kv_with_rotary(self, qkv: torch.Tensor, rope: Any) -> bool:
        """Rotate q/k inside ``qkv`` [T, (H + 2*Hkv) * D] and write this step's K/V into the cache in one
        kernel, when the backend allows it (CUDA, Triton); False: nothing done, rotate and attend as usual."""
        if self.kv_cache is None or not self.spec.uses_kv_cache or self.sinks is not None \
                or not self.backend.takes_kv_from_rotary(qkv):
            return False
        if is_fp8(self.kv_cache.dtype):
            return False  # an fp8 cache quantizes with the layer's scales as the backend stores K/V
        rope.rotate_qk_and_write_kv(qkv, self.num_heads, self.num_kv_heads, self.kv_cache,
                                    get_attn_metadata(self.kv_group).slot_mapping)
        return True


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers in ``layer_idx`` order."""
    return sorted((m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx)


def bind_kv_caches(model: nn.Module, kv_caches: list[torch.Tensor], groups: list[int] | None = None) -> None:
    """Give each cached Attention layer (by ``layer_idx``) its cache tensor and, when ``groups`` is given,
    its KV cache group (one entry per cached layer); encoder layers get none. A layer with an fp8 cache keeps its
    keys rotated (``Attention.key_rotation``) unless its scales are the checkpoint's: those were calibrated on
    keys as the model computes them, and rotated keys can reach past them."""
    layers = [m for m in attention_layers(model) if m.spec.uses_kv_cache]
    if len(layers) != len(kv_caches):
        raise ValueError(f"model has {len(layers)} cached attention layers but {len(kv_caches)} KV caches")
    for i, layer in enumerate(layers):
        layer.kv_cache = kv_caches[layer.layer_idx]
        layer.kv_group = groups[i] if groups is not None else 0
        layer.kv_scale = layer.kv_scale.to(layer.kv_cache.device)
        rotate = is_fp8(layer.kv_cache.dtype) and not layer.kv_scales_from_checkpoint
        layer.key_rotation = KeyRotation.for_head_size(layer.head_size) if rotate else None


#: Who reads a step's metadata: (KV cache group, backend, the specs of that backend's layers there).
StepReaders = list[tuple[int, AttentionBackend, frozenset[AttentionSpec]]]


def step_readers(model: nn.Module) -> StepReaders:
    """The layers of ``model`` that read the metadata of a model runner's step: its cached layers by KV cache
    group, and the encoder layers of an encoder-only model (an encoder-decoder model's encoder reads metadata of
    its own, built in its forward)."""
    layers = attention_layers(model)
    cached = [m for m in layers if m.spec.uses_kv_cache]
    readers: dict[tuple[int, AttentionBackend], set[AttentionSpec]] = {}
    for layer in cached or layers:
        readers.setdefault((layer.kv_group, layer.backend), set()).add(layer.spec)
    return [(group, backend, frozenset(specs)) for (group, backend), specs in readers.items()]


def prepare_step_states(meta: AttentionMetadata, readers: StepReaders) -> None:
    """Each backend's per-step state, built once before the forward (``AttentionBackend.prepare_step``): what
    every caller does after building a step's metadata and before running layers over it (a forward over metadata
    nobody prepared raises)."""
    for group, backend, specs in readers:
        backend.prepare_step(meta.for_group(group), specs)


@contextmanager
def attention_step(meta: AttentionMetadata, readers: StepReaders) -> Iterator[AttentionMetadata]:
    """A step that its caller builds and runs itself (the draft model, Whisper's encoder, the profiling step,
    graph captures, tests): the backends' state prepared (``prepare_step_states``), then ``meta`` in the forward
    context for the layers, until the block ends."""
    prepare_step_states(meta, readers)
    with forward_context(meta):
        yield meta
