"""Attention with sinks (gpt-oss): each head has a learned logit ``s_h`` that joins the softmax's denominator and
attends to nothing, so a query can put weight "nowhere":

    p_j = exp(l_j) / (exp(s_h) + sum_i exp(l_i)),   out = sum_j p_j v_j   (l_j = scale * q . k_j)

Plain torch over the paged cache, any device, for causal and sliding-window layers (a query at position p sees keys
``p - window < j <= p``, reading only the blocks that hold them). Every layer with sinks takes this path whatever
the engine's backend is (the C++ and Triton kernels have no sink term): the step's decodes in one batched call,
every other request (prompts, chunks, prefix-cache hits) one call each. It reads host lists of the metadata, so a
step through it is neither a CUDA graph nor a CPU step graph (``worker.py`` leaves such models eager).
"""

from __future__ import annotations

import torch

from pagedllm.attention.backends.paged_kv import write_kv
from pagedllm.attention.metadata import AttentionMetadata


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, first_block: torch.Tensor, num_blocks: int,
            dtype: torch.dtype) -> torch.Tensor:
    """K or V of ``num_blocks`` consecutive logical blocks per request from ``first_block``, in ``dtype``.

    cache: [num_blocks_total, bs, Hkv, D]; block_tables: [R, nb]; first_block: [R] int64 -> [R, Hkv, n*bs, D].
    Logical blocks past a table's end are clamped to its last entry (the caller masks their positions)."""
    idx = first_block[:, None] + torch.arange(num_blocks, device=first_block.device)[None, :]
    blocks = block_tables.gather(1, idx.clamp(max=block_tables.shape[1] - 1).long())  # [R, n]
    gathered = cache[blocks]  # [R, n, bs, Hkv, D]
    r, n, bs, hkv, d = gathered.shape
    return gathered.view(r, n * bs, hkv, d).transpose(1, 2).to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
            sinks: torch.Tensor) -> torch.Tensor:
    """q [R, Hkv, G, Q, D], k/v [R, Hkv, L, D], visible [R, Q, L] bool, sinks [Hkv, G] -> [R, Hkv, G, Q, D].

    Scores and softmax in float32; positions not visible get no weight (their values are zeroed too, so stale or
    never-written cache rows cannot turn the sum into NaN)."""
    scores = torch.einsum("rhgqd,rhld->rhgql", q.float(), k.float()) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    sink = sinks.float()[None, :, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    v = v.float().masked_fill(~visible.any(dim=1)[:, None, :, None], 0.0)
    return torch.einsum("rhgql,rhld->rhgqd", probs, v).to(q.dtype)


def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    """query [T, H, D], key/value [T, Hkv, D] (this step's new tokens, written to ``kv_cache`` by slot first),
    sinks [H] (this rank's heads), ``window`` None for a causal layer -> [T, H, D].

    kv_cache: [2, num_blocks, block_size, Hkv, D], in the model's dtype: these reads apply no fp8 scales, so the
    worker refuses an fp8 cache for a model with sink layers."""
    write_kv(kv_cache, key, value, meta.slot_mapping)
    _, num_heads, head_dim = query.shape
    num_kv_heads, bs = kv_cache.shape[-2], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    sinks = sinks.view(num_kv_heads, group)  # query head h = kv head h // group, as GQA pairs them
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # query may be a strided view
    dev = query.device
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    nd = meta.num_decodes
    if nd:  # one batched call: each decode reads from its window's first block (block 0 for a causal layer)
        seq = meta.seq_lens[:nd].long()
        first = (seq - window).clamp(min=0) // bs if window else torch.zeros_like(seq)
        n = (-(-window // bs) + 1) if window else -(-meta.max_decode_seq_len // bs)
        n = min(n, meta.block_tables.shape[1])
        k = _gather(key_cache, meta.block_tables[:nd], first, n, query.dtype)  # [nd, Hkv, n*bs, D]
        v = _gather(value_cache, meta.block_tables[:nd], first, n, query.dtype)
        pos = first[:, None] * bs + torch.arange(n * bs, device=dev)[None, :]  # [nd, L]
        visible = pos < seq[:, None]
        if window:
            visible &= pos >= seq[:, None] - window
        q = query[:nd].view(nd, num_kv_heads, group, 1, head_dim)
        out[:nd] = _attend(q, k, v, visible[:, None, :], scale, sinks).view(nd, num_heads, head_dim)
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i in range(nd, meta.num_reqs):
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        q_len = end - start
        if not q_len:
            continue
        first_pos = max(0, seq_len - q_len - window + 1) if window else 0  # the earliest key any query sees
        first = first_pos // bs
        n = -(-seq_len // bs) - first
        firsts = torch.tensor([first], device=dev)
        k = _gather(key_cache, meta.block_tables[i:i + 1], firsts, n, query.dtype)  # [1, Hkv, L, D]
        v = _gather(value_cache, meta.block_tables[i:i + 1], firsts, n, query.dtype)
        kv_pos = first * bs + torch.arange(n * bs, device=dev)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)
        visible = kv_pos[None, :] <= q_pos[:, None]
        if window:
            visible &= kv_pos[None, :] > q_pos[:, None] - window
        q = query[start:end].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).unsqueeze(0)
        o = _attend(q, k, v, visible[None], scale, sinks)  # [1, Hkv, G, Q, D]
        out[start:end] = o[0].permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
    return out
