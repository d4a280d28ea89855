"""Cross-attention (``AttentionSpec.cross()``): each decoder token attends to all of its request's encoder
positions, whose K/V the model wrote once into the cross-attention KV cache group (``models/whisper.py``).

The step's metadata for that group (``worker/encoder_decoder.py``) has the decoder's query layout and, per
request, the group's block table and ``seq_len`` = the encoder's length. Nothing is masked: every query sees
every encoder position. The C++ paged kernel is causal over a request's context, so each query token is handed
to it as a request of its own (one query, the whole encoder context): exactly the unmasked attention. The
portable path gathers each request's K/V once and runs SDPA without a mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.attention.backends.paged_kv import gather_tokens
from pagedllm.attention.backends.torch_state import missing, torch_state
from pagedllm.attention.metadata import AttentionMetadata


def build_cross_layout(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """(query_start [T + 1], seq_lens [T], block_tables [T, nb], rows [T]) int32: one kernel request per query
    token (built once per step, before the forward, by the backend's ``build_state``)."""
    device = meta.block_tables.device
    num_tokens = meta.num_actual_tokens
    rows = torch.arange(num_tokens, dtype=torch.int32, device=device)
    if meta.num_decodes == meta.num_reqs:  # one query each already
        return meta.query_start_loc, meta.seq_lens, meta.block_tables, rows
    qsl = meta.query_start_loc_cpu
    counts = torch.tensor([qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)], device=device)
    row_of_token = torch.repeat_interleave(torch.arange(meta.num_reqs, device=device), counts)
    seq = torch.full((num_tokens,), meta.seq_lens_cpu[0], dtype=torch.int32, device=device)
    starts = torch.arange(num_tokens + 1, dtype=torch.int32, device=device)
    return starts, seq, meta.block_tables.index_select(0, row_of_token).contiguous(), rows


def cross_layout(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """The step's kernel layout, as ``build_cross_layout`` prepared it (RuntimeError if nobody did)."""
    layout = torch_state(meta).cross_layout
    if layout is None:
        raise missing("cross-attention layout")
    return layout


def cross_attention(query: torch.Tensor, kv_cache: torch.Tensor | None, meta: AttentionMetadata, scale: float,
                    kernels: Any | None = None) -> torch.Tensor:
    """query: [T, H, D] -> [T, H, D], attending to the K/V in ``kv_cache`` ([2, num_blocks, block_size, Hkv, D])
    through ``meta.block_tables``, ``meta.seq_lens[i]`` encoder positions for request i."""
    if kv_cache is None:
        raise RuntimeError("a cross-attention layer has no KV cache bound (the cross-attention group's)")
    if kernels is not None and kv_cache.dtype in (torch.float32, torch.bfloat16):
        starts, seq, tables, rows = cross_layout(meta)
        q32 = query.float().contiguous()
        out32 = torch.empty_like(q32)
        kernels.paged_attention(q32, kv_cache[0], kv_cache[1], tables, seq, starts, out32, scale, rows)
        return out32 if query.dtype == torch.float32 else out32.to(query.dtype)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    qsl, nd = meta.query_start_loc_cpu, meta.num_decodes
    if nd:  # decodes in one batched call: [nd, Hkv, G, D] queries over [nd, Hkv, L, D] keys
        length = max(meta.seq_lens_cpu[:nd])
        k = gather_tokens(kv_cache[0], meta.block_tables[:nd], length, query.dtype)
        v = gather_tokens(kv_cache[1], meta.block_tables[:nd], length, query.dtype)
        q = query[:nd].view(nd, num_kv_heads, group, head_dim)
        out[:nd] = F.scaled_dot_product_attention(q, k, v, scale=scale).reshape(nd, num_heads, head_dim)
    for i in range(nd, meta.num_reqs):
        start, end, length = qsl[i], qsl[i + 1], meta.seq_lens_cpu[i]
        k = gather_tokens(kv_cache[0], meta.block_tables[i:i + 1], length, query.dtype)
        v = gather_tokens(kv_cache[1], meta.block_tables[i:i + 1], length, query.dtype)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=group > 1)
        out[start:end] = o[0].transpose(0, 1)
    return out
