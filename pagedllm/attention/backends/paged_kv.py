"""The paged KV cache as plain torch sees it: storing a step's K/V by slot and gathering a request's rows
through its block table, in the dtype the reader needs (the cache may keep another: --kv-cache-dtype)."""

from __future__ import annotations

import torch


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V by slot.

    kv_cache: [2, num_blocks, block_size, Hkv, D]; key/value: [T, Hkv, D]; slot_mapping: [T] int64.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))  # no-op casts unless the cache's dtype differs
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_tokens(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D], block_tables: [R, nb] -> [R, Hkv, num_tokens, D] in ``dtype``
    (the query's: a cache kept in another dtype, --kv-cache-dtype, is widened or narrowed here)."""
    block_size = cache.shape[1]
    nblocks = -(num_tokens // -block_size)
    gathered = cache[block_tables[:, :nblocks]]  # [R, nb, bs, Hkv, D]
    r, _, _, hkv, d = gathered.shape
    return gathered.view(r, nblocks * block_size, hkv, d)[:, :num_tokens].transpose(1, 2).to(dtype)


def as_stored(t: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded as the cache keeps it, in its own dtype: attention sees a step's new K/V as later steps will
    read them back, whichever path serves a row (a chunked prompt's later chunks read the first from the cache)."""
    return t if t.dtype == cache_dtype else t.to(cache_dtype).to(t.dtype)
