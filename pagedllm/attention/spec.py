"""What one attention layer attends to: its per-layer spec, carried by the layer, read by the backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

AttentionKind = Literal["causal", "sliding", "encoder", "cross"]


@dataclass(frozen=True)
class AttentionSpec:
    """``causal``: every earlier token; ``sliding``: the last ``window`` tokens including itself (the
    transformers convention: key j is seen by query i when ``i - window < j <= i``); ``encoder``: every
    token of the same sequence, no mask and no KV cache; ``cross``: a decoder's cross-attention to its request's
    encoder output, whose K/V sit in a KV cache group of their own (written once per request, never masked)."""

    kind: AttentionKind = "causal"
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "sliding" and (self.window is None or self.window < 1):
            raise ValueError(f"a sliding-window attention layer needs a window >= 1, got {self.window}")
        if self.kind != "sliding" and self.window is not None:
            raise ValueError(f"only sliding-window layers take a window (kind {self.kind!r})")

    @classmethod
    def causal(cls) -> AttentionSpec:
        return cls("causal")

    @classmethod
    def sliding(cls, window: int) -> AttentionSpec:
        return cls("sliding", int(window))

    @classmethod
    def encoder(cls) -> AttentionSpec:
        return cls("encoder")

    @classmethod
    def cross(cls) -> AttentionSpec:
        return cls("cross")

    @property
    def uses_kv_cache(self) -> bool:
        return self.kind != "encoder"

    def window_for(self, max_seq_len: int) -> int | None:
        """The window that matters for a step whose longest request holds ``max_seq_len`` tokens: None
        when nothing falls out of it (the layer then behaves exactly like a causal one)."""
        if self.kind == "sliding" and max_seq_len > self.window:
            return self.window
        return None


def layer_attention_specs(hf_config: Any) -> list[AttentionSpec]:
    """One spec per decoder layer from a transformers config.

    ``layer_types`` (transformers 5: ``"full_attention"`` / ``"sliding_attention"``) wins; otherwise a set
    ``sliding_window`` (and ``use_sliding_window`` not False, as in Qwen2's config) makes every layer sliding.
    """
    num_layers = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers, the model has {num_layers}")
        specs = []
        for kind in layer_types:
            if kind == "sliding_attention":
                if not window:
                    raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
                specs.append(AttentionSpec.sliding(window))
            elif kind == "full_attention":
                specs.append(AttentionSpec.causal())
            else:
                raise ValueError(f"layer type {kind!r} is not supported (full_attention, sliding_attention)")
        return specs
    if window and getattr(hf_config, "use_sliding_window", True) is not False:
        return [AttentionSpec.sliding(window)] * num_layers
    return [AttentionSpec.causal()] * num_layers


def common_sliding_window(specs: list[AttentionSpec]) -> int | None:
    """The window when every cached layer slides with the same window (then KV blocks that fall out of it
    can be freed for all layers at once); None otherwise."""
    cached = [s for s in specs if s.uses_kv_cache]
    if cached and all(s.kind == "sliding" for s in cached) and len({s.window for s in cached}) == 1:
        return cached[0].window
    return None


def kv_cache_groups(specs: list[AttentionSpec]) -> tuple[list[int], int | None]:
    """Split a hybrid model's cached layers into KV cache groups: (the group of each cached layer, the
    sliding group's window). Group 0 holds the full (causal) layers, group 1 the sliding layers of one
    window, whose blocks out of the window can be freed while group 0 keeps the whole context. Any other
    model (one kind of layer, or sliding layers of several windows) keeps one group: ([0, ...], None).
    An encoder-decoder model's cross-attention layers are group 1 (window None): the encoder output's K/V."""
    cached = [s for s in specs if s.uses_kv_cache]
    if any(s.kind == "cross" for s in cached):
        return [1 if s.kind == "cross" else 0 for s in cached], None
    windows = {s.window for s in cached if s.kind == "sliding"}
    if len(windows) == 1 and any(s.kind == "causal" for s in cached):
        return [1 if s.kind == "sliding" else 0 for s in cached], windows.pop()
    return [0] * len(cached), None
