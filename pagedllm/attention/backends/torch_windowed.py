"""Portable attention for sliding-window layers, reading only the window through the block tables. Plain
torch, any device. (Bidirectional encoder layers: ``torch_encoder``.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata


def _gather_window(cache: torch.Tensor, block_tables: torch.Tensor, first_block: torch.Tensor,
                   num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """K or V of ``num_blocks`` consecutive logical blocks per request, starting at ``first_block``, in ``dtype``
    (the query's).

    cache: [num_blocks_total, bs, Hkv, D]; block_tables: [R, nb]; first_block: [R] int64 -> [R, Hkv, n*bs, D].
    Logical blocks past a table's end are clamped (their positions are masked out by the caller).
    """
    idx = (first_block[:, None] + torch.arange(num_blocks, device=first_block.device)[None, :])
    idx = idx.clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables.gather(1, idx.to(block_tables.dtype).long())  # [R, n]
    gathered = cache[blocks]  # [R, n, bs, Hkv, D]
    r, n, bs, hkv, d = gathered.shape
    return gathered.view(r, n * bs, hkv, d).transpose(1, 2).to(dtype)


def sliding_window_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int,
                             scale: float, out: torch.Tensor) -> None:
    """Every request reads K/V (already written for this step) from the cache, only the blocks that hold
    keys inside some query's window: query at position p sees keys ``p - window < j <= p``.

    query/out: [T, H, D]; kv_cache: [2, num_blocks, bs, Hkv, D].
    """
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    bs = meta.block_size
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    dev = query.device
    nd = meta.num_decodes
    if nd:
        # One batched call: each decode reads ceil(window / bs) + 1 blocks from its window's first block.
        seq = meta.seq_lens[:nd].long()
        first = (seq - window).clamp(min=0) // bs
        n = -(-window // bs) + 1
        k = _gather_window(key_cache, meta.block_tables[:nd], first, n, query.dtype)  # [nd, Hkv, n*bs, D]
        v = _gather_window(value_cache, meta.block_tables[:nd], first, n, query.dtype)
        pos = first[:, None] * bs + torch.arange(n * bs, device=dev)[None, :]
        mask = (pos < seq[:, None]) & (pos >= seq[:, None] - window)
        q = query[:nd].view(nd, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
        out[:nd] = o.reshape(nd, num_heads, head_dim)
    for i in range(nd, meta.num_reqs):
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        q_len = end - start
        first_pos = max(0, seq_len - q_len - window + 1)  # earliest key any of these queries sees
        first = first_pos // bs
        n = -(-seq_len // bs) - first
        k = _gather_window(key_cache, meta.block_tables[i:i + 1], torch.tensor([first], device=dev), n, query.dtype)
        v = _gather_window(value_cache, meta.block_tables[i:i + 1], torch.tensor([first], device=dev), n, query.dtype)
        kv_pos = first * bs + torch.arange(n * bs, device=dev)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)
        mask = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] > q_pos[:, None] - window)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[start:end] = o[0].transpose(0, 1)
