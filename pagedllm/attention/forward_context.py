"""A scoped per-step context so attention layers can find this step's metadata.

Models never see requests: the model runner enters ``forward_context(metadata)`` around the forward
pass, and each ``Attention`` layer reads the metadata from here. The context ends with the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pagedllm.attention.metadata import AttentionMetadata

_current: AttentionMetadata | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata | None) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def get_attn_metadata(group: int = 0) -> AttentionMetadata:
    """This step's metadata for KV cache group ``group`` (group 0's carries the others, if any)."""
    if _current is None:
        raise RuntimeError("attention called outside forward_context(); the model runner sets it per step")
    return _current.for_group(group)


def current_attn_metadata() -> AttentionMetadata | None:
    """This step's metadata, or None outside ``forward_context`` (a model run on its own)."""
    return _current
