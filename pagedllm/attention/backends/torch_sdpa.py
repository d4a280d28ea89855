"""Paged attention, the portable path: torch SDPA for fresh prompts, and for requests with earlier context SDPA
over K/V gathered through the block tables. It is the reference and serves any device; the CPU backend
(``cpu_paged``) sends what its C++ kernels take to them and the rest here.
Sliding-window layers go through ``torch_windowed``, encoder layers through ``torch_encoder``, cross-attention
layers through ``cross_attention``; ``TorchPagedAttentionBackend`` routes by the layer's spec.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.backends.cross_attention import build_cross_layout, cross_attention
from pagedllm.attention.backends.paged_kv import as_stored, gather_tokens, is_fp8, kv_scale_of, write_kv
from pagedllm.attention.backends.torch_encoder import encoder_attention, encoder_state
from pagedllm.attention.backends.torch_state import TorchStepState, missing, torch_state
from pagedllm.attention.backends.torch_windowed import sliding_window_attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec


@dataclass
class AttentionPlan:
    """How the torch and CPU backends split the batch, worked out once per step and shared by all layers.

    ``fresh_groups``: query length -> requests with no earlier context (a whole prompt in one step);
    ``with_context``: every other request (decodes, later prefill chunks, prefix-cache hits), and
    ``query_lens`` of every request.
    """

    fresh_groups: dict[int, list[int]]
    with_context: list[int]
    with_context_tensor: torch.Tensor  # [n] int32
    query_lens: list[int]
    #: What backends derive from the plan and the query's dtype once per step for every layer (the CPU backend's
    #: kernel split, whose limits depend on the dtype): worked out at the first layer, memoized here.
    memo: dict[Any, Any] = field(default_factory=dict)
    _chunk_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def chunk_mask(self, i: int, meta: AttentionMetadata) -> torch.Tensor:
        """[q_len, seq_len] bool for request i with context: its query j sits at position seq_len - q_len + j and
        sees keys up to and including itself. Memoized: every layer asks for the same (which requests need one
        depends on the path the query's dtype takes, known at the first layer)."""
        mask = self._chunk_masks.get(i)
        if mask is None:
            seq_len, device = meta.seq_lens_cpu[i], meta.seq_lens.device
            q_pos = torch.arange(seq_len - self.query_lens[i], seq_len, device=device)
            mask = self._chunk_masks[i] = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        return mask


def plan_step(meta: AttentionMetadata) -> AttentionPlan:
    """Split ``meta``'s requests into fresh prompts (by query length) and requests with earlier context (what
    ``build_state`` keeps as the step's ``paged_plan``)."""
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    fresh: dict[int, list[int]] = {}
    other: list[int] = []
    query_lens = [qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)]
    for i, q_len in enumerate(query_lens):
        if q_len > 1 and seq_lens[i] == q_len:
            fresh.setdefault(q_len, []).append(i)
        else:
            other.append(i)
    return AttentionPlan(fresh, other, torch.tensor(other, dtype=torch.int32, device=meta.seq_lens.device), query_lens)


def step_plan(meta: AttentionMetadata) -> AttentionPlan:
    """The step's plan, as ``build_state`` prepared it (RuntimeError if it did not)."""
    plan = torch_state(meta).paged_plan
    if plan is None:
        raise missing("paged plan")
    return plan


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """query: [T, H, D]; key/value: [T, Hkv, D] (this step's new tokens) -> output [T, H, D].

    K/V of this step are written to the cache first; requests with earlier context read it from there, fresh
    prompts attend to their own new K/V. ``kv_scale``: an fp8 cache's [2] k/v scales (``paged_kv``).
    """
    write_kv(kv_cache, key, value, meta.slot_mapping, kv_scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # query may be a strided view
    plan = step_plan(meta)
    if plan.with_context:
        _attend_with_context(query, kv_cache, meta, plan.with_context, scale, out, kv_scale)
    attend_fresh_groups(query, key, value, kv_cache, meta, plan.fresh_groups, scale, out, kv_scale)
    return out


def attend_fresh_groups(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, groups: dict[int, list[int]], scale: float, out: torch.Tensor,
                        kv_scale: torch.Tensor | None = None) -> None:
    """Fresh prompts (query length -> requests) through SDPA over their own K/V, read as the cache stores them."""
    if not groups:
        return
    key = as_stored(key, kv_cache.dtype, kv_scale_of(kv_scale, 0))
    value = as_stored(value, kv_cache.dtype, kv_scale_of(kv_scale, 1))
    for q_len, rows in groups.items():
        _attend_fresh(query, key, value, meta, q_len, rows, scale, out)


def _attend_with_context(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         rows: list[int], scale: float, out: torch.Tensor,
                         kv_scale: torch.Tensor | None = None) -> None:
    """Portable path: the step's decodes batched, the other requests in ``rows`` one by one."""
    if meta.num_decodes:
        _attend_decodes(query, kv_cache, meta, scale, out, kv_scale)
    chunks = [i for i in rows if i >= meta.num_decodes]
    if chunks:
        attend_chunks(query, kv_cache, meta, chunks, scale, out, kv_scale)


def _attend_decodes(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor, kv_scale: torch.Tensor | None) -> None:
    """Portable path: the step's decodes (its first ``num_decodes`` requests) in one SDPA call over K/V gathered
    through their block tables."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    nd = meta.num_decodes
    seq_len = meta.max_decode_seq_len
    tables = meta.block_tables[:nd]
    k = gather_tokens(kv_cache[0], tables, seq_len, query.dtype, kv_scale_of(kv_scale, 0))  # [nd, Hkv, L, D]
    v = gather_tokens(kv_cache[1], tables, seq_len, query.dtype, kv_scale_of(kv_scale, 1))
    # GQA without copying K/V: the query heads of one KV group become G query rows.
    q = query[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = torch.arange(seq_len, device=query.device)[None, :] < meta.seq_lens[:nd, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    out[:nd] = o.reshape(nd, num_heads, head_dim)


def attend_chunks(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, rows: list[int],
                   scale: float, out: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """Requests ``rows`` with earlier context (none a decode), one SDPA call each over K/V gathered through
    its block table: the portable path's, and the CPU backend's for long chunks."""
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[-2]
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    plan = step_plan(meta)
    for i in rows:
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]: 4-D (see _attend_fresh)
        table = meta.block_tables[i:i + 1]
        k = gather_tokens(kv_cache[0], table, seq_len, query.dtype, kv_scale_of(kv_scale, 0))  # [1, Hkv, L, D]
        v = gather_tokens(kv_cache[1], table, seq_len, query.dtype, kv_scale_of(kv_scale, 1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.chunk_mask(i, meta), scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[start:end] = o[0].transpose(0, 1)


def _attend_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata,
                  q_len: int, rows: list[int], scale: float, out: torch.Tensor) -> None:
    """Prompts with no earlier context, all of length q_len: causal attention over their own K/V."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    gqa = num_heads != num_kv_heads
    starts = [meta.query_start_loc_cpu[i] for i in rows]
    # 4-D [batch, heads, L, D] inputs throughout: torch's CPU SDPA takes a much slower path for 3-D ones
    # (docs/performance.md).
    if starts == list(range(starts[0], starts[0] + q_len * len(rows), q_len)):
        # Contiguous in the flat batch: one batched call on views, no copy.
        span = slice(starts[0], starts[0] + q_len * len(rows))
        q = query[span].view(len(rows), q_len, num_heads, head_dim).transpose(1, 2)
        k = key[span].view(len(rows), q_len, num_kv_heads, head_dim).transpose(1, 2)
        v = value[span].view(len(rows), q_len, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out[span] = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
        return
    for start in starts:
        end = start + q_len
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)


class TorchPagedAttentionBackend(AttentionBackend):
    """Portable torch attention (SDPA), the reference every other backend is tested against; it runs on any
    device. ``CpuPagedAttentionBackend`` is this with the C++ kernels where they apply.

    Sliding-window layers whose step holds no request longer than the window behave exactly like causal
    ones and take the causal path; otherwise they read only the window (``torch_windowed``).
    """

    name = "torch"
    state_type = TorchStepState

    def _kernels(self, tensor: torch.Tensor) -> Any | None:
        """The C++ kernels that the encoder and cross-attention paths take for this step's tensors (the CPU
        backend's), or None: the portable path."""
        return None

    def _paged_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, kv_scale: torch.Tensor | None) -> torch.Tensor:
        """A causal layer's attention (``paged_attention``'s contract); the CPU backend routes to its kernels."""
        return paged_attention(query, key, value, kv_cache, meta, scale, kv_scale)

    def build_state(self, meta: AttentionMetadata, specs: Collection[AttentionSpec]) -> TorchStepState:
        """The pieces the layers of ``specs`` will read: the paged plan (causal layers, and sliding ones this
        step is not longer than), the encoder's offsets or buckets, the kernel's cross-attention layout."""
        kernels = self._kernels(meta.seq_lens)
        state = TorchStepState()
        if any(s.kind in ("causal", "sliding") and s.window_for(meta.max_seq_len) is None for s in specs):
            state.paged_plan = plan_step(meta)
        if any(s.kind == "encoder" for s in specs):
            state.encoder_query_start, state.encoder_plan = encoder_state(meta, kernels)
        if kernels is not None and any(s.kind == "cross" for s in specs):
            state.cross_layout = build_cross_layout(meta)
        return state

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata, spec: AttentionSpec, scale: float,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        if spec.kind == "encoder":
            return encoder_attention(query, key, value, meta, scale, self._kernels(query))
        if kv_cache is not None and is_fp8(kv_cache.dtype) and spec.kind != "causal":
            raise ValueError(f"kv_cache_dtype: an fp8 KV cache serves causal attention layers only, not {spec.kind} "
                             "ones")
        if spec.kind == "cross":
            return cross_attention(query, kv_cache, meta, scale, self._kernels(query))
        if kv_cache is None:
            raise RuntimeError("a causal or sliding-window attention layer has no KV cache bound")
        window = spec.window_for(meta.max_seq_len)
        if window is None:
            return self._paged_attention(query, key, value, kv_cache, meta, scale, kv_scale)
        write_kv(kv_cache, key, value, meta.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        sliding_window_attention(query, kv_cache, meta, window, scale, out)
        return out
