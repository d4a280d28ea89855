"""Rotary position embeddings (rotate-half layout) with a cos/sin table built once per model.

Partial rotary (``partial_rotary_factor`` < 1: only the first ``rotary_dim`` dims of each head turn, pairing i with
i + rotary_dim / 2, as transformers does) needs no kernel of its own: the table stays ``head_dim`` wide with
cos 1 / sin 0 past the rotary frequencies, and the model reorders its q/k rows at load (``partial_rotary_order``)
so that each rotary pair lands on a pair the full-width kernels turn and every other dim on a pair they leave as
it is. q . k is unchanged by a reordering applied to both.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.kernel_binding import KernelBinding


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
    factors = getattr(hf_config, "rope_freq_factors", None)  # a GGUF's rope_freqs tensor (Llama 3.1)
    if factors:
        if rope_type_of(params) != "default":
            raise ValueError(f"rope: both rope_freq_factors and rope_type {rope_type_of(params)!r} are set")
        params = {**params, "rope_type": "freq_factors", "freq_factors": list(factors)}
    return theta, params


def partial_rotary_factor(hf_config: Any) -> float:
    """The share of each head that rotates: ``partial_rotary_factor`` of the config or of its ``rope_parameters``."""
    value = getattr(hf_config, "partial_rotary_factor", None)
    if value is None:
        value = (getattr(hf_config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    return float(value or 1.0)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim] int64: the checkpoint dim each of a head's dims takes (new[j] = old[order[j]]) so that rotary pair
    (i, i + r/2), i < r/2, sits at (i, i + D/2) and the D - r other dims at the pairs the table leaves unturned."""
    r_half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(r_half), torch.arange(rotary_dim, rotary_dim + rest),
                      torch.arange(r_half, rotary_dim), torch.arange(rotary_dim + rest, head_dim)]).long()


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)


def rope_type_of(scaling: dict[str, Any]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default")) or "default"


def _yarn(head_dim: int, theta: float, scaling: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (as transformers computes it): high frequencies kept, low ones divided by ``factor``, a linear
    ramp between the dims that turn ``beta_fast`` and ``beta_slow`` times over the original context."""
    old_len = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_position / old_len)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_for(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0.0, 1.0)
    inv_freq = _default_inv_freq(head_dim, theta)
    keep = 1.0 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate (divided by factor)
    return inv_freq / factor * (1.0 - keep) + inv_freq * keep, float(attn)


def longrope_attention_factor(scaling: dict[str, Any], max_position: int) -> float:
    """LongRoPE's cos/sin scale: sqrt(1 + ln(factor) / ln(original length)), factor = max / original."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_position / old_len)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any],
              max_position: int = 0) -> tuple[torch.Tensor, float]:
    """([head_dim // 2] float64 inverse frequencies after the configured scaling, cos/sin scale factor).

    LongRoPE is handled by ``RotaryEmbedding`` itself (two tables); this gives its short table's frequencies.
    """
    inv_freq = _default_inv_freq(head_dim, theta)
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended linearly.
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, max_position)
    if rope_type == "freq_factors":  # llama.cpp's rope_freqs: each frequency divided by its own factor
        return inv_freq / _factors(scaling["freq_factors"], head_dim), 1.0
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3, yarn, longrope)")


def _factors(factors: Any, head_dim: int, what: str = "rope_freqs") -> torch.Tensor:
    ext = torch.tensor([float(f) for f in factors], dtype=torch.float64, device="cpu")
    if ext.numel() != head_dim // 2:
        raise ValueError(f"{what}: {ext.numel()} factors for a rotary dim of {head_dim} (need {head_dim // 2})")
    return ext


def _longrope_inv_freq(head_dim: int, theta: float, factors: Any) -> torch.Tensor:
    return _default_inv_freq(head_dim, theta) / _factors(factors, head_dim, "longrope")


class RotaryEmbedding(DirectCall, nn.Module):
    """Holds cos/sin for every position up to ``max_position``; layers share one lookup per step.

    LongRoPE (Phi-3 "longrope"/"su"): two tables, short factors then long ones, stacked as [2P, D]; a
    request whose length this step exceeds ``original_max_position_embeddings`` reads the long half (for all
    of this step's tokens), as transformers picks the set from the longest position of each forward pass.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any],
                 dtype: torch.dtype, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim != head_dim and (rotary_dim % 2 or head_dim % 2 or not 0 < rotary_dim < head_dim
                                       or rope_type_of(scaling) in ("longrope", "su")):
            raise ValueError(f"partial rotary: {rotary_dim} rotary dims of a {head_dim}-dim head are not supported "
                             "(both even, rotary < head; not with longrope)")
        # Built on the CPU explicitly (the model may be constructed on the meta device), kept as a plain
        # attribute so `to_empty()` does not wipe it; moved to the model's device on first use.
        self.long_offset = 0  # LongRoPE: row offset of the long table, 0 otherwise
        self.original_max_position = 0
        if rope_type_of(scaling) in ("longrope", "su"):
            scale = longrope_attention_factor(scaling, max_position)
            tables = [_cos_sin(max_position, _longrope_inv_freq(head_dim, theta, scaling[key]), scale)
                      for key in ("short_factor", "long_factor")]
            self.cos_sin_cache = torch.cat(tables).to(dtype)  # [2P, D]
            self.long_offset = max_position
            self.original_max_position = int(scaling["original_max_position_embeddings"])
        else:
            inv_freq, scale = _inv_freq(rotary_dim, theta, scaling, max_position)
            if rotary_dim != head_dim:  # cos 1, sin 0 past the rotary frequencies: those pairs stay as they are
                inv_freq = torch.cat([inv_freq, inv_freq.new_zeros((head_dim - rotary_dim) // 2)])
                unturned = torch.zeros(head_dim // 2, dtype=torch.bool)
                unturned[rotary_dim // 2:] = True
                table = _cos_sin(max_position, inv_freq, scale)
                table[:, :head_dim // 2][:, unturned] = 1.0
                table[:, head_dim // 2:][:, unturned] = 0.0
                self.cos_sin_cache = table.to(dtype)  # [P, D]
            else:
                self.cos_sin_cache = _cos_sin(max_position, inv_freq, scale).to(dtype)  # [P, D]
        # The in-place rotary kernel for activations like qkv and this table (its dtype is fixed from here on).
        table_dtype = self.cos_sin_cache.dtype
        self.rotary_kernels = KernelBinding(lambda platform, dtype: platform.rotary_family(dtype, table_dtype))

    def table_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: [T] int64 -> the rows of the cos/sin table to read (the positions themselves, or for
        LongRoPE shifted into the long table for requests longer than the original context)."""
        if not self.long_offset:
            return positions
        from pagedllm.attention.forward_context import current_attn_metadata

        meta = current_attn_metadata()
        if meta is None:  # one sequence outside the engine: transformers' rule on the whole batch
            long = bool(positions.numel()) and int(positions.max()) >= self.original_max_position
            return positions + self.long_offset if long else positions
        # Device tensors only, no host sync and no data-dependent branch: safe under CUDA graph capture
        # (whose host copies of the lengths describe shapes, not lengths).
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        offsets = (meta.seq_lens > self.original_max_position).long() * self.long_offset
        per_token = torch.repeat_interleave(offsets, query_lens, output_size=positions.numel())
        return positions + per_token

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


def _cos_sin(max_position: int, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """[P, D] float64: cos of every position's angles, then sin, times ``scale`` (YaRN / LongRoPE)."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64, device="cpu"), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table * scale if scale != 1.0 else table


class RopeStep:
    """One step's rotary inputs, shared by every layer: positions plus, for the torch path, cos/sin rows."""

    def __init__(self, emb: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.emb = emb
        self.positions = emb.table_rows(positions)  # rows of the emb's table (positions, unless LongRoPE)
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def rotate_qk(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv: [T, (H + 2*Hkv) * D] laid out [q | k | v] -> rotated q [T, H*D] and k [T, Hkv*D].

        On CPU in float32 or bfloat16 and on CUDA the rotation is done in place inside ``qkv`` and q/k are views of it.
        """
        d = self.emb.head_dim
        q_size, kv_size = num_heads * d, num_kv_heads * d
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        kernels = self.emb.rotary_kernels(qkv)
        if kernels is not None and qkv.dim() == 2:
            kernels.rotary_(qkv, self.positions, self.emb.table_on(qkv.device), num_heads + num_kv_heads, d)
            return q, k
        if self._cos_sin is None:
            self._cos_sin = self.emb.lookup(self.positions)
        cos, sin = self._cos_sin
        return apply_rotary(q, cos, sin, num_heads), apply_rotary(k, cos, sin, num_kv_heads)

    def rotate_qk_and_write_kv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor) -> None:
        """``rotate_qk`` in place plus the layer's KV-cache write, as one Triton kernel (CUDA): kv_cache
        [2, num_blocks, block_size, Hkv, D] receives each token's rotated k and its v at ``slot_mapping`` [T]."""
        from pagedllm.kernels import triton_ops

        triton_ops.rotary_and_write_kv_(qkv, self.positions, self.emb.table_on(qkv.device), num_heads, num_kv_heads,
                                        self.emb.head_dim, kv_cache, slot_mapping)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
    """x: [T, H*D], cos/sin: [T, 1, D/2] -> rotated [T, H*D] (rotate-half pairing: i with i + D/2)."""
    t = x.shape[0]
    x = x.view(t, num_heads, -1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(t, -1)
