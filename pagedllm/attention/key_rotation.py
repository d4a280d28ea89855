"""Queries and keys of an fp8 KV cache turned by one orthogonal rotation of the head dimension.

Why: e4m3 keeps 3 mantissa bits, so each stored key element carries a relative error of up to 2^-4. A score q.k is
mostly carried by a few large channels (RoPE's slow pairs), and their rounding errors go straight into it. Turning
q and k by the same orthogonal matrix leaves every score as it was (qR).(kR) = q.k, but spreads each channel over
the whole head, so the errors of many small elements average out instead (docs/kv_cache_fp8.md has the
perplexities). Values are left as they are: their rounding barely moves the output.

The rotation is a block-diagonal Walsh-Hadamard matrix (blocks of the largest power of two dividing the head size),
its ±1 entries scaled by powers of two only: keys by 2^-ceil(log2(b)/2), queries by 2^-floor(log2(b)/2), whose
product is the 1/b that makes it orthogonal. Every entry is exact in bf16, half and float32, so rotating in the
model's dtype rounds once and two instances on any hardware build the same bytes."""

from __future__ import annotations

import dataclasses
import functools

import torch


def hadamard_block_size(head_size: int) -> int:
    """The largest power of two dividing ``head_size`` (the order of each Hadamard block)."""
    if head_size < 1:
        raise ValueError(f"head_size must be positive, got {head_size}")
    return head_size & -head_size


@dataclasses.dataclass(frozen=True)
class KeyRotation:
    """The rotation of one head size: blocks of order ``block``, queries scaled by ``query_scale`` and keys by
    ``key_scale`` (``query_scale * key_scale * block == 1``)."""

    head_size: int
    block: int
    query_scale: float
    key_scale: float

    @classmethod
    def for_head_size(cls, head_size: int) -> KeyRotation:
        block = hadamard_block_size(head_size)
        log2b = block.bit_length() - 1
        return cls(head_size, block, 2.0 ** -(log2b // 2), 2.0 ** -((log2b + 1) // 2))

    def scale(self, which: str) -> float:
        """The scale of the ``"query"`` or ``"key"`` matrix."""
        return {"query": self.query_scale, "key": self.key_scale}[which]

    def matrix(self, which: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The ``"query"`` or ``"key"`` matrix, [D, D] in ``dtype`` on ``device``: rows multiplied by it (x @ R).
        Built once per (which, dtype, device): a CUDA graph replays the same tensor."""
        return _hadamard(self.head_size, self.block, self.scale(which), dtype, str(device))


@functools.cache
def _hadamard(head_size: int, block: int, scale: float, dtype: torch.dtype, device: str) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (torch.block_diag(*([h] * (head_size // block))) * scale).to(dtype=dtype, device=device)


def rotate_heads_(x: torch.Tensor, rotation: KeyRotation, which: str) -> None:
    """In place, portable torch: x [T, H, D] (any float dtype, rows and heads may be strided) <- x @ the
    ``which`` ("query" / "key") matrix, computed in x's dtype."""
    t, h, d = x.shape
    x.copy_(torch.matmul(x.reshape(t * h, d), rotation.matrix(which, x.dtype, x.device)).view(t, h, d))
