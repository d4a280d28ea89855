"""Bidirectional encoder attention (``AttentionSpec.encoder()``): every token sees every token of its own
sequence, no KV cache, no mask beyond the sequence boundary. Every backend routes encoder layers here: on a
CPU with the C++ kernels one kernel call per layer (``encoder_attention``), elsewhere plain torch:

Sequences are bucketed by length (multiples of ``BUCKET_STEP`` up to ``MIN_POW2_BUCKET``, powers of two
above), each bucket is gathered into a padded [n, H, L, D] block and run through one SDPA call with a
key-padding mask. A step of many short sentences thus costs a handful of SDPA calls per layer (not one
per sentence), padding wastes little, and no token attends to padding or to another sequence. The plan
depends only on the step's sequence lengths, so it is built once per step, before the forward (in the backends'
state, ``encoder_state``), and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.attention.backends.torch_state import missing, torch_state
from pagedllm.attention.metadata import AttentionMetadata

ENCODER_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
BUCKET_STEP = 16  # sequences up to MIN_POW2_BUCKET tokens are bucketed by multiples of this
MIN_POW2_BUCKET = 128  # longer ones by powers of two (few buckets even with long-tail lengths)
# Longest sequence the C++ encoder kernel's generic path attends; SDPA's blocked matmuls win beyond it (the bf16
# kernels, AMX tiles or AVX-512 BF16 dot products, take any length): Whisper's 1500-position encoder ran slower
# through the generic kernel than through SDPA (docs/performance.md). BERT's prompts (<= 512) keep the kernel.
ENCODER_KERNEL_MAX_LEN = 512


@dataclass
class EncoderBucket:
    num_seqs: int
    length: int  # padded length L
    gather: torch.Tensor  # [n * L] int64: token of each padded slot (padding repeats the sequence's first)
    key_mask: torch.Tensor | None  # [n, 1, 1, L] bool, True for real keys; None when nothing is padded


@dataclass
class EncoderAttentionPlan:
    """One step's buckets, and where each token's output sits in their concatenated padded outputs."""

    buckets: list[EncoderBucket]
    token_to_slot: torch.Tensor  # [T] int64
    num_padded_tokens: int

    @property
    def in_place(self) -> bool:
        """One bucket with nothing padded: its gather is the identity (the sequences tile the step in order), so
        the projections' rows are attended as views, with no gather or scatter (Whisper's 1,500-position clips)."""
        return len(self.buckets) == 1 and self.buckets[0].key_mask is None


def bucket_length(length: int) -> int:
    """The padded length a sequence of ``length`` tokens is attended at."""
    if length <= MIN_POW2_BUCKET:
        return -(-length // BUCKET_STEP) * BUCKET_STEP
    return 1 << (length - 1).bit_length()


def plan_encoder_attention(query_start_loc: list[int], device: torch.device | str = "cpu") -> EncoderAttentionPlan:
    """Bucket the sequences of one step (``query_start_loc``: [R + 1] host offsets)."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for i in range(len(query_start_loc) - 1):
        start, length = query_start_loc[i], query_start_loc[i + 1] - query_start_loc[i]
        groups.setdefault(bucket_length(length), []).append((start, length))
    buckets = []
    token_to_slot = torch.empty(query_start_loc[-1], dtype=torch.int64)
    offset = 0
    for seqs in groups.values():
        starts = torch.tensor([s for s, _ in seqs], dtype=torch.int64)
        lens = torch.tensor([n for _, n in seqs], dtype=torch.int64)
        length = int(lens.max())  # the bucket's longest, not its upper bound
        pos = torch.arange(length)
        valid = pos[None, :] < lens[:, None]  # [n, L]
        gather = torch.where(valid, starts[:, None] + pos, starts[:, None]).flatten()
        real_slots = valid.flatten().nonzero().squeeze(1)
        token_to_slot[gather[real_slots]] = real_slots + offset
        offset += gather.numel()
        key_mask = None if bool(valid.all()) else valid[:, None, None, :].to(device)
        buckets.append(EncoderBucket(len(seqs), length, gather.to(device), key_mask))
    return EncoderAttentionPlan(buckets, token_to_slot.to(device), offset)


def _check_whole_sequences(meta: AttentionMetadata) -> None:
    qsl = meta.query_start_loc_cpu
    if any(qsl[i + 1] - qsl[i] != meta.seq_lens_cpu[i] for i in range(meta.num_reqs)):
        raise ValueError("encoder attention needs each sequence whole in one step (no chunked prefill)")


def encoder_plan(meta: AttentionMetadata) -> EncoderAttentionPlan:
    """The step's buckets, as ``encoder_state`` prepared them (RuntimeError if it did not)."""
    plan = torch_state(meta).encoder_plan
    if plan is None:
        raise missing("encoder buckets")
    return plan


def bucketed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: EncoderAttentionPlan,
                       scale: float | None = None) -> torch.Tensor:
    """query: [T, H, D]; key/value: [T, Hkv, D] (views into a fused projection are fine) -> [T, H * D]."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    if plan.in_place:
        n, length = plan.buckets[0].num_seqs, plan.buckets[0].length
        q, k, v = (t.view(n, length, t.shape[1], head_dim).transpose(1, 2) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=num_heads != num_kv_heads)
        return o.transpose(1, 2).reshape(-1, num_heads * head_dim)
    padded = torch.empty(plan.num_padded_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    offset = 0
    for b in plan.buckets:
        n, length = b.num_seqs, b.length
        # index_select, not x[idx]: on CPU the advanced-indexing gather is far slower for these shapes
        # (docs/performance.md).
        q = query.index_select(0, b.gather).view(n, length, num_heads, head_dim).transpose(1, 2)  # [n, H, L, D]
        k = key.index_select(0, b.gather).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        v = value.index_select(0, b.gather).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=b.key_mask, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        padded[offset:offset + n * length].view(n, length, num_heads, head_dim).copy_(o.transpose(1, 2))
        offset += n * length
    return padded.view(-1, num_heads * head_dim).index_select(0, plan.token_to_slot)


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata,
                      scale: float, kernels: Any | None = None) -> torch.Tensor:
    """The backends' encoder path. query: [T, H, D]; key/value: [T, Hkv, D] -> [T, H, D].

    With the C++ CPU kernels (``kernels``) each (sequence, head) is attended in place, with no gather, padding or
    mask: a bf16 query of any length in a bf16 kernel where the CPU has one (``bf16_kernel``: AMX tiles or AVX-512
    BF16 dot products, either faster than torch's flash attention on Whisper's 1,500 positions; figures:
    docs/performance.md), float32 and bf16 of at most ``ENCODER_KERNEL_MAX_LEN`` tokens in the generic kernel
    (``encoder_attention.cpp``); otherwise the length buckets above.
    """
    if kernels is not None and query.dtype in ENCODER_KERNEL_DTYPES:
        kernel = bf16_kernel(kernels, query)
        if kernel is not None or meta.max_query_len <= ENCODER_KERNEL_MAX_LEN:
            return kernels.encoder_attention(query, key, value, _query_start_cpu(meta), scale, kernel or "generic")
    elif kernels is not None and meta.max_query_len <= ENCODER_KERNEL_MAX_LEN:
        # A dtype the kernels lack (float16) on a step prepared for them, which take every float32 and bf16 step
        # this short: bucketed here, per layer, as the prepared state holds no buckets for it.
        plan = plan_encoder_attention(meta.query_start_loc_cpu, meta.query_start_loc.device)
        return bucketed_attention(query, key, value, plan, scale).view(query.shape)
    return bucketed_attention(query, key, value, encoder_plan(meta), scale).view(query.shape)


def bf16_kernel(kernels: Any, query: torch.Tensor, causal: bool = False) -> str | None:
    """The bf16 kernel that attends ``query`` here ("amx", "avx512_bf16"), or None: not bf16, a head dim the kernels
    lack, a CPU with neither, or ``PAGEDLLM_ENCODER_ATTENTION_BF16`` ruling it out.

    ``causal``: a decoder's prompts and their later chunks (``encoder_attention(..., causal=True)``), which the AMX
    kernel does not run, taken only on CPUs without AMX tiles unless the switch names ``avx512_bf16``: there torch's
    SDPA runs its bf16 products on the same AVX-512 BF16 dot products plus an accurate exp, several times slower
    than the kernel; with tiles its blocked matmuls run on them (figures for both: docs/performance.md).
    """
    choice = envs.PAGEDLLM_ENCODER_ATTENTION_BF16
    if choice == "off" or query.dtype != torch.bfloat16:
        return None
    if causal and choice == "auto" and "amx" in kernels.encoder_attention_kernels(query):
        return None
    able = kernels.encoder_attention_kernels(query, causal)  # fastest first
    return next((k for k in able if k != "generic" and choice in ("auto", k)), None)


def _query_start_cpu(meta: AttentionMetadata) -> torch.Tensor:
    """The step's sequence offsets as an int32 host tensor, as ``encoder_state`` prepared them."""
    offsets = torch_state(meta).encoder_query_start
    if offsets is None:
        raise missing("encoder offsets")
    return offsets


def encoder_state(meta: AttentionMetadata, kernels: Any | None
                  ) -> tuple[torch.Tensor | None, EncoderAttentionPlan | None]:
    """Before the forward: what ``encoder_attention`` will read on this step, (the kernels' offsets, the buckets).
    With ``kernels`` the offsets, and the buckets too for a step longer than ``ENCODER_KERNEL_MAX_LEN`` (only a bf16
    kernel takes those, and the query's dtype is known at the layer only); without, the buckets."""
    _check_whole_sequences(meta)
    if kernels is None:
        return None, plan_encoder_attention(meta.query_start_loc_cpu, meta.query_start_loc.device)
    offsets = torch.tensor(meta.query_start_loc_cpu, dtype=torch.int32)
    if meta.max_query_len <= ENCODER_KERNEL_MAX_LEN:
        return offsets, None
    return offsets, plan_encoder_attention(meta.query_start_loc_cpu, meta.query_start_loc.device)
