"""Bidirectional attention for encoder models (BERT): every token sees every token of its own sequence.

Self-contained on purpose: no KV cache and no paged metadata, only where each sequence starts in the flat
batch. Sequences are bucketed by length (powers of two), each bucket is gathered into a padded
[n, H, L, D] block and run through one SDPA call with a key-padding mask, so a step of many short sentences
costs a handful of calls per layer (not one per sentence), padding at most doubles a bucket's length, and
no token ever attends to padding or to another sequence. The plan is built once per step and shared by
all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MIN_BUCKET = 16  # sequences up to this many tokens share one bucket


@dataclass
class _Bucket:
    num_seqs: int
    length: int  # padded length L
    gather: torch.Tensor  # [n * L] int64: token of each padded slot (padding repeats the sequence's first)
    key_mask: torch.Tensor | None  # [n, 1, 1, L] bool, True for real keys; None when nothing is padded


@dataclass
class EncoderAttentionPlan:
    """One step's buckets, and where each token's output sits in their concatenated padded outputs."""

    buckets: list[_Bucket]
    token_to_slot: torch.Tensor  # [T] int64


def plan_encoder_attention(query_start_loc: list[int], device: torch.device | str = "cpu") -> EncoderAttentionPlan:
    """Bucket the sequences of one step (``query_start_loc``: [R + 1] host offsets)."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for i in range(len(query_start_loc) - 1):
        start, length = query_start_loc[i], query_start_loc[i + 1] - query_start_loc[i]
        bucket = max(MIN_BUCKET, 1 << (length - 1).bit_length())
        groups.setdefault(bucket, []).append((start, length))
    buckets = []
    token_to_slot = torch.empty(query_start_loc[-1], dtype=torch.int64)
    offset = 0
    for seqs in groups.values():
        starts = torch.tensor([s for s, _ in seqs], dtype=torch.int64)
        lens = torch.tensor([n for _, n in seqs], dtype=torch.int64)
        length = int(lens.max())
        pos = torch.arange(length)
        valid = pos[None, :] < lens[:, None]  # [n, L]
        gather = torch.where(valid, starts[:, None] + pos, starts[:, None]).flatten()
        real_slots = valid.flatten().nonzero().squeeze(1)
        token_to_slot[gather[real_slots]] = real_slots + offset
        offset += gather.numel()
        key_mask = None if bool(valid.all()) else valid[:, None, None, :].to(device)
        buckets.append(_Bucket(len(seqs), length, gather.to(device), key_mask))
    return EncoderAttentionPlan(buckets, token_to_slot.to(device))


def encoder_attention_qkv(qkv: torch.Tensor, plan: EncoderAttentionPlan, scale: float | None = None) -> torch.Tensor:
    """qkv: [T, 3, H, D] (q, k and v of each token side by side, as a fused projection yields them) ->
    [T, H * D]. One gather per bucket for all three."""
    num_tokens, _, num_heads, head_dim = qkv.shape
    total = sum(b.num_seqs * b.length for b in plan.buckets)
    padded = torch.empty(total, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    offset = 0
    for b in plan.buckets:
        n, length = b.num_seqs, b.length
        # [n * L, 3, H, D] -> [3, n, H, L, D]
        q, k, v = qkv[b.gather].view(n, length, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=b.key_mask, scale=scale)  # [n, H, L, D]
        padded[offset:offset + n * length].view(n, length, num_heads, head_dim).copy_(o.transpose(1, 2))
        offset += n * length
    return padded.view(total, num_heads * head_dim)[plan.token_to_slot]


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: list[int],
                      scale: float | None = None, plan: EncoderAttentionPlan | None = None) -> torch.Tensor:
    """q, k, v: [T, H, D] for a flat batch of sequences; ``query_start_loc``: [R + 1] offsets (host list).

    Returns [T, H * D]. Attention never crosses a sequence boundary and is not causal. ``plan``: from
    ``plan_encoder_attention`` (pass it to skip re-planning in every layer).
    """
    if plan is None:
        plan = plan_encoder_attention(query_start_loc, q.device)
    return encoder_attention_qkv(torch.stack((q, k, v), dim=1), plan, scale)
