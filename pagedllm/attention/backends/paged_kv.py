"""The paged KV cache as plain torch sees it: storing a step's K/V by slot and gathering a request's rows
through its block table, in the dtype the reader needs (the cache may keep another: --kv-cache-dtype).

An fp8 cache (float8_e4m3fn / float8_e5m2) keeps each layer's K/V divided by its scales, ``kv_scale`` ([2]
float32: k_scale, v_scale; None: 1.0), saturated to the format's range: stored = fp8(clamp(x / scale)), read
back as stored * scale."""

from __future__ import annotations

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a KV cache of ``dtype`` stores 8-bit floats with per-layer scales."""
    return dtype in FP8_KV_DTYPES


def quantize_kv(t: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``t`` as an fp8 cache of ``cache_dtype`` stores it: t / scale, saturated to the format's largest finite
    value, rounded to nearest even (torch's cast)."""
    x = t.float() if scale is None else t.float() / scale
    bound = torch.finfo(cache_dtype).max
    return x.clamp(-bound, bound).to(cache_dtype)


def dequantize_kv(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """fp8 rows ``t`` read back in ``dtype``: stored * scale (computed in float32, then cast)."""
    x = t.float() if scale is None else t.float() * scale
    return x.to(dtype)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Store new K/V by slot.

    kv_cache: [2, num_blocks, block_size, Hkv, D]; key/value: [T, Hkv, D]; slot_mapping: [T] int64;
    kv_scale: [2] float32 (an fp8 cache's k/v scales; None: 1.0).
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    if is_fp8(kv_cache.dtype):
        # torch has no index_copy_ for fp8: the same bytes through uint8 views
        raw = flat.view(torch.uint8)
        for i, t in enumerate((key, value)):
            raw[i].index_copy_(0, slot_mapping, quantize_kv(t, kv_cache.dtype, kv_scale_of(kv_scale, i))
                               .view(torch.uint8))
        return
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))  # no-op casts unless the cache's dtype differs
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_tokens(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int,
                  dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D], block_tables: [R, nb] -> [R, Hkv, num_tokens, D] in ``dtype``
    (the query's: a cache kept in another dtype, --kv-cache-dtype, is widened or narrowed here; an fp8 cache's
    rows are multiplied by ``scale``, its k or v scale)."""
    block_size = cache.shape[1]
    nblocks = -(num_tokens // -block_size)
    gathered = cache[block_tables[:, :nblocks]]  # [R, nb, bs, Hkv, D]
    r, _, _, hkv, d = gathered.shape
    rows = gathered.view(r, nblocks * block_size, hkv, d)[:, :num_tokens].transpose(1, 2)
    return dequantize_kv(rows, dtype, scale) if is_fp8(cache.dtype) else rows.to(dtype)


def as_stored(t: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` rounded as the cache keeps it, in its own dtype: attention sees a step's new K/V as later steps will
    read them back, whichever path serves a row (a chunked prompt's later chunks read the first from the cache).
    ``scale``: an fp8 cache's k or v scale."""
    if is_fp8(cache_dtype):
        return dequantize_kv(quantize_kv(t, cache_dtype, scale), t.dtype, scale)
    return t if t.dtype == cache_dtype else t.to(cache_dtype).to(t.dtype)


def kv_scale_of(kv_scale: torch.Tensor | None, which: int) -> torch.Tensor | None:
    """The k (0) or v (1) scale of a layer's ``kv_scale`` [2], or None."""
    return None if kv_scale is None else kv_scale[which]
