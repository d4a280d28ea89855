"""Portable paged attention on top of ``torch.nn.functional.scaled_dot_product_attention``.

This is the reference backend (CPU and CUDA). Decodes are batched into one SDPA call over K/V gathered
through the block tables; prefill chunks run one SDPA call each (a few per step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V by slot.

    kv_cache: [2, num_blocks, block_size, Hkv, D]; key/value: [T, Hkv, D]; slot_mapping: [T] int64.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hkv, D], block_tables: [R, nb] -> [R, Hkv, num_tokens, D]."""
    block_size = cache.shape[1]
    nblocks = -(num_tokens // -block_size)
    gathered = cache[block_tables[:, :nblocks]]  # [R, nb, bs, Hkv, D]
    r, _, _, hkv, d = gathered.shape
    return gathered.view(r, nblocks * block_size, hkv, d)[:, :num_tokens].transpose(1, 2)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query: [T, H, D]; key/value: [T, Hkv, D] (this step's new tokens) -> output [T, H, D].

    K/V of this step are written to the cache first, so every request reads its whole context from it
    (except a prefill with no earlier context, which attends to its own fresh K/V directly).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    write_kv(kv_cache, key, value, meta.slot_mapping)
    out = torch.empty_like(query)
    key_cache, value_cache = kv_cache[0], kv_cache[1]

    nd = meta.num_decodes
    if nd:
        seq_len = meta.max_decode_seq_len
        tables = meta.block_tables[:nd]
        k = _gather(key_cache, tables, seq_len)  # [nd, Hkv, L, D]
        v = _gather(value_cache, tables, seq_len)
        # GQA without copying K/V: the query heads of one KV group become G query rows.
        q = query[:nd].view(nd, num_kv_heads, group, head_dim)
        mask = torch.arange(seq_len, device=query.device)[None, :] < meta.seq_lens[:nd, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
        out[:nd] = o.reshape(nd, num_heads, head_dim)

    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    # Fresh prefills (no earlier context) of equal length run as one batched causal SDPA call.
    fresh: dict[int, list[int]] = {}
    for i in range(nd, meta.num_reqs):
        q_len = qsl[i + 1] - qsl[i]
        if seq_lens[i] == q_len:
            fresh.setdefault(q_len, []).append(i)
            continue
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        table = meta.block_tables[i:i + 1]
        k = _gather(key_cache, table, seq_len)[0]  # [Hkv, L, D]
        v = _gather(value_cache, table, seq_len)[0]
        # Query j sits at position seq_len - q_len + j and sees keys up to and including itself.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[start:end] = o.transpose(0, 1)
    for q_len, rows in fresh.items():
        starts = [qsl[i] for i in rows]
        if len(rows) > 1 and starts == list(range(starts[0], starts[0] + q_len * len(rows), q_len)):
            # Contiguous in the flat batch: a view, no copy.
            span = slice(starts[0], starts[0] + q_len * len(rows))
            q = query[span].view(len(rows), q_len, num_heads, head_dim).transpose(1, 2)
            k = key[span].view(len(rows), q_len, num_kv_heads, head_dim).transpose(1, 2)
            v = value[span].view(len(rows), q_len, num_kv_heads, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
            out[span] = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
            continue
        for start in starts:
            end = start + q_len
            q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
            out[start:end] = o.transpose(0, 1)
    return out
