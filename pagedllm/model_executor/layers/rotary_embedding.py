"""Rotary position embeddings (rotate-half layout) with a cos/sin table built once per model."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.kernels.dispatch import elementwise_kernels_for


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from a transformers config.

    transformers 5 keeps everything in ``config.rope_parameters``; older configs use ``rope_theta`` plus an
    optional ``rope_scaling`` dict. Both are accepted.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling:
        params = {**scaling, **params}
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0))
    return theta, params


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """[head_dim // 2] float64 inverse frequencies, after the configured scaling."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended linearly.
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Holds cos/sin for every position up to ``max_position``; layers share one lookup per step."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, theta, scaling)
        # Built on the CPU explicitly (the model may be constructed on the meta device), kept as a plain
        # attribute so `to_empty()` does not wipe it; moved to the model's device on first use.
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64, device="cpu"),
                            inv_freq)
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)  # [P, D]

    def table_on(self, device: torch.device) -> torch.Tensor:
        """The [P, D] cos/sin table on ``device`` (moved there once)."""
        if self.cos_sin_cache.device != device:
            self.cos_sin_cache = self.cos_sin_cache.to(device)
        return self.cos_sin_cache

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, 1, D/2] (broadcast over heads)."""
        cache = self.table_on(positions.device)
        cos, sin = cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


class RopeStep:
    """One step's rotary inputs, shared by every layer: positions plus, for the torch path, cos/sin rows."""

    def __init__(self, emb: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.emb = emb
        self.positions = positions
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def rotate_qk(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv: [T, (H + 2*Hkv) * D] laid out [q | k | v] -> rotated q [T, H*D] and k [T, Hkv*D].

        On CPU in float32 and on CUDA the rotation is done in place inside ``qkv`` and q/k are views of it.
        """
        d = self.emb.head_dim
        q_size, kv_size = num_heads * d, num_kv_heads * d
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        kernels = elementwise_kernels_for(qkv)  # CPU float32 (table in float32 too) or CUDA (any dtype)
        if kernels is not None and qkv.dim() == 2 and (qkv.is_cuda or self.emb.cos_sin_cache.dtype == torch.float32):
            kernels.rotary_(qkv, self.positions, self.emb.table_on(qkv.device), num_heads + num_kv_heads, d)
            return q, k
        if self._cos_sin is None:
            self._cos_sin = self.emb.lookup(self.positions)
        cos, sin = self._cos_sin
        return apply_rotary(q, cos, sin, num_heads), apply_rotary(k, cos, sin, num_kv_heads)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
    """x: [T, H*D], cos/sin: [T, 1, D/2] -> rotated [T, H*D] (rotate-half pairing: i with i + D/2)."""
    t = x.shape[0]
    x = x.view(t, num_heads, -1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(t, -1)
