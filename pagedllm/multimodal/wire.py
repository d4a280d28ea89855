"""A request's images across process boundaries (the API process -> an engine core, rank 0 -> the other
tensor-parallel ranks): each ``MultiModalFeature`` as a msgspec struct with its processed arrays as raw bytes + shape
+ dtype (msgpack copies bytes as they are; the receiver wraps them in arrays without another copy)."""

from __future__ import annotations

import msgspec
import numpy as np

from pagedllm.core.multimodal import MultiModalFeature


class WireArray(msgspec.Struct, array_like=True):
    data: bytes
    shape: list[int]
    dtype: str


class WireFeature(msgspec.Struct, array_like=True):
    identifier: str
    offset: int
    length: int
    modality: str
    arrays: dict[str, WireArray]
    embed_mask: bytes | None = None


def pack_mm_features(features: list[MultiModalFeature]) -> list[WireFeature] | None:
    if not features:
        return None
    return [WireFeature(f.identifier, f.offset, f.length, f.modality,
                        {name: WireArray(np.ascontiguousarray(a).tobytes(), list(a.shape), a.dtype.str)
                         for name, a in (f.data or {}).items()}, f.embed_mask) for f in features]


def unpack_mm_features(wire: list[WireFeature] | None) -> list[MultiModalFeature]:
    return [MultiModalFeature(w.identifier, w.offset, w.length, w.modality,
                              {name: np.frombuffer(a.data, dtype=np.dtype(a.dtype)).reshape(a.shape)
                               for name, a in w.arrays.items()}, w.embed_mask) for w in wire or []]
