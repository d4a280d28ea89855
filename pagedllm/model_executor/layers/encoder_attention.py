"""Bidirectional attention for encoder models (BERT): every token sees every token of its own sequence.

Self-contained on purpose: no KV cache and no paged metadata, only where each sequence starts in the flat
batch. Sequences of equal length are stacked and run through one SDPA call, so a batch of many short
sentences costs a few calls, not one per sentence, and no padding is ever attended to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: list[int],
                      scale: float | None = None) -> torch.Tensor:
    """q, k, v: [T, H, D] for a flat batch of sequences; ``query_start_loc``: [R + 1] offsets (host list).

    Returns [T, H * D]. Attention never crosses a sequence boundary and is not causal.
    """
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    by_len: dict[int, list[int]] = {}
    for i in range(len(query_start_loc) - 1):
        by_len.setdefault(query_start_loc[i + 1] - query_start_loc[i], []).append(query_start_loc[i])
    for length, starts in by_len.items():
        if len(starts) == 1:  # a plain slice, no gather
            s = starts[0]
            qs, ks, vs = (t[s:s + length].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [1, H, L, D]
            out[s:s + length] = o[0].transpose(0, 1)
            continue
        idx = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
        n = len(starts)
        qs, ks, vs = (t[idx].view(n, length, num_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [n, H, L, D]
        out[idx] = o.transpose(1, 2).reshape(n * length, num_heads, head_dim)
    return out.view(num_tokens, num_heads * head_dim)
