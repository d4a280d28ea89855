"""pagedllm's paged attention as a transformers attention implementation.

transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key,
value, attention_mask, scaling=..., sliding_window=..., ...)``. We register one function under ``"pagedllm"``; it
hands the call to whatever handler the fallback model put in scope for this forward:

- ``AttentionProbe`` (once, at load): records what each layer passes (heads, head size, scale, window, soft cap)
  so the model can build one pagedllm ``Attention`` per layer and the worker can size the KV cache from them;
- ``PagedLayers`` (every step): runs the layer's pagedllm ``Attention`` (KV written by slot, read by block table,
  the engine's backend), as a native model's attention would.

The handler is scoped like the forward context (``use_attention_handler``), so nothing outlives a forward. No
mask is built: transformers skips mask creation for an implementation it has no mask function for, and the
backends mask from the step's metadata.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.attention.forward_context import get_attn_metadata
from pagedllm.attention.spec import AttentionSpec
from pagedllm.model_executor.layers.attention import Attention

ATTN_IMPLEMENTATION = "pagedllm"

_handler: Any = None


@contextmanager
def use_attention_handler(handler: Any) -> Iterator[None]:
    """``handler`` receives the registered function's calls until the block ends."""
    global _handler
    previous, _handler = _handler, handler
    try:
        yield
    finally:
        _handler = previous


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The function transformers calls: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    if _handler is None:
        raise RuntimeError("the pagedllm attention implementation runs only inside a pagedllm fallback model's "
                           "forward")
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:  # met by the probe at load, so a model that lacks it never starts
        raise ValueError(f"model: the transformers fallback cannot run this architecture: its {type(module).__name__} "
                         "has no layer_idx, so pagedllm cannot tell which layer's KV cache it uses")
    return _handler.attend(int(layer_idx), module, query, key, value, kwargs), None


def register_paged_attention() -> None:
    """Register ``paged_attention_forward`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


@dataclass(frozen=True)
class LayerCall:
    """What one transformers attention layer passed: its heads, head size, scale, window and causality."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None
    is_causal: bool

    def spec(self) -> AttentionSpec:
        if not self.is_causal:
            return AttentionSpec.encoder()
        return AttentionSpec.sliding(self.sliding_window) if self.sliding_window else AttentionSpec.causal()


class AttentionProbe:
    """Records each layer's ``LayerCall`` over one short forward; refuses what the backends cannot do."""

    def __init__(self, architecture: str) -> None:
        self.architecture = architecture
        self.calls: dict[int, LayerCall] = {}

    def attend(self, layer_idx: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        why = None
        if kwargs.get("softcap") is not None:
            why = f"attention logit soft-capping (softcap={kwargs['softcap']})"
        elif kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
            why = "attention sinks"
        elif value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
            why = f"value head size {value.shape[-1]} != query head size {query.shape[-1]}"
        elif query.shape[1] % key.shape[1]:
            why = f"{query.shape[1]} query heads over {key.shape[1]} KV heads"
        if why is not None:
            raise ValueError(f"model: {self.architecture} through the transformers fallback: layer {layer_idx} "
                             f"uses {why}, which pagedllm's paged attention backends do not support")
        scale = kwargs.get("scaling")
        window = kwargs.get("sliding_window")
        self.calls[layer_idx] = LayerCall(
            num_heads=query.shape[1], num_kv_heads=key.shape[1], head_size=query.shape[-1],
            scale=float(scale) if scale is not None else query.shape[-1] ** -0.5,
            sliding_window=int(window) if window else None, is_causal=bool(getattr(module, "is_causal", True)))
        return query.transpose(1, 2)  # any [1, T, H, D] will do: the probe's outputs are thrown away


class PagedLayers:
    """Each transformers attention call goes to the pagedllm ``Attention`` of its ``layer_idx``."""

    def __init__(self, layers: list[Attention]) -> None:
        self.layers = layers

    def attend(self, layer_idx: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        layer = self.layers[layer_idx]
        if layer.kv_cache is None and layer.spec.uses_kv_cache:
            raise RuntimeError(f"no KV cache bound to attention layer {layer_idx}")
        # [1, H, T, D] -> [T, H, D], each token's heads one row (what the kernels read and the cache stores).
        q = query[0].transpose(0, 1).contiguous()
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
        layer.rotate_for_cache(q, k)
        layer.maybe_calculate_kv_scales(k, v)
        out = layer.backend.forward(q, k, v, layer.kv_cache, get_attn_metadata(layer.kv_group), layer.spec,
                                    layer.scale, layer.kv_scale)
        return out.unsqueeze(0)
