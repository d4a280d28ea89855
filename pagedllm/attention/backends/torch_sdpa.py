"""Paged attention: torch SDPA for fresh prompts, and for requests with earlier context either the C++
CPU kernel (reads K/V through block tables in place) or the portable path (SDPA over K/V gathered
through the block tables). The portable path is the reference and serves CUDA. Sliding-window layers go
through ``torch_windowed``, encoder layers through ``torch_encoder``, cross-attention layers through
``cross_attention``; ``TorchPagedAttentionBackend`` routes
by the layer's spec.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.backends.cross_attention import cross_attention, cross_layout
from pagedllm.attention.backends.paged_kv import as_stored, gather_tokens, write_kv
from pagedllm.attention.backends.torch_encoder import encoder_attention, prepare_encoder_state
from pagedllm.attention.backends.torch_state import TORCH_STATE_KEY, TorchStepState, torch_state
from pagedllm.attention.backends.torch_windowed import sliding_window_attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec


@dataclass
class AttentionPlan:
    """How the torch and CPU backends split the batch, worked out once per step and shared by all layers.

    ``fresh_groups``: query length -> requests with no earlier context (a whole prompt in one step);
    ``with_context``: every other request (decodes, later prefill chunks, prefix-cache hits).
    """

    fresh_groups: dict[int, list[int]]
    with_context: list[int]
    with_context_tensor: torch.Tensor  # [n] int32
    _kernel_splits: dict[int, tuple[torch.Tensor | None, dict[int, list[int]]]] = field(default_factory=dict)

    def kernel_split(self, max_fresh_len: int) -> tuple[torch.Tensor | None, dict[int, list[int]]]:
        """For a backend whose kernel also takes fresh prompts of up to ``max_fresh_len`` tokens:
        (the kernel's requests as an int32 tensor, or None if none; the fresh groups left for SDPA).
        Memoized, since every layer asks the same."""
        if max_fresh_len not in self._kernel_splits:
            rows = list(self.with_context)
            rest: dict[int, list[int]] = {}
            for q_len, group in self.fresh_groups.items():
                if q_len <= max_fresh_len:
                    rows.extend(group)
                else:
                    rest[q_len] = group
            if len(rows) == len(self.with_context):
                tensor = self.with_context_tensor if rows else None
            else:
                tensor = torch.tensor(sorted(rows), dtype=torch.int32, device=self.with_context_tensor.device)
            self._kernel_splits[max_fresh_len] = (tensor, rest)
        return self._kernel_splits[max_fresh_len]


def step_plan(meta: AttentionMetadata) -> AttentionPlan:
    """The step's plan (built once per step: by ``build_state``, else by the first layer that asks)."""
    state = torch_state(meta)
    if state.paged_plan is None:
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        fresh: dict[int, list[int]] = {}
        other: list[int] = []
        for i in range(meta.num_reqs):
            q_len = qsl[i + 1] - qsl[i]
            if q_len > 1 and seq_lens[i] == q_len:
                fresh.setdefault(q_len, []).append(i)
            else:
                other.append(i)
        state.paged_plan = AttentionPlan(fresh, other, torch.tensor(other, dtype=torch.int32,
                                                                    device=meta.seq_lens.device))
    return state.paged_plan


# Longest fresh prompt the CPU kernel attends; beyond it SDPA is faster. One layer of the default model,
# 2 cores: 16 x 128 tokens 9.5 ms (kernel) vs 13.2 ms (SDPA); 4 x 512: 27.6 vs 24.3; 2 x 1024: 66 vs 31.
FRESH_PROMPT_KERNEL_MAX_LEN = 256


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    kernels: Any | None = None) -> torch.Tensor:
    """query: [T, H, D]; key/value: [T, Hkv, D] (this step's new tokens) -> output [T, H, D].

    K/V of this step are written to the cache first; requests with earlier context read it from there
    (through the C++ CPU kernels when ``kernels`` is given, else the portable path), fresh prompts attend to
    their own new K/V.
    """
    if kernels is not None:
        kernels.write_kv(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)
    else:
        write_kv(kv_cache, key, value, meta.slot_mapping)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # query may be a strided view
    plan = step_plan(meta)
    if kernels is not None:
        # The kernel also takes fresh prompts of up to FRESH_PROMPT_KERNEL_MAX_LEN tokens (reading their
        # K/V back from the cache while it is hot); longer ones go to SDPA's blocked matmuls.
        kernel_rows, sdpa_fresh = plan.kernel_split(FRESH_PROMPT_KERNEL_MAX_LEN)
        if kernel_rows is not None:
            # float32, or bf16 with a bf16 cache (the kernel widens each token's query itself); any other
            # query goes through float32 copies.
            native = query.dtype == torch.float32 or query.dtype == kv_cache.dtype == torch.bfloat16
            q_in = query if native else query.float()
            out_k = out if native else torch.empty_like(q_in)
            kernels.paged_attention(q_in, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, out_k, scale, kernel_rows)
            if out_k is not out:
                out.copy_(out_k)  # rows left to SDPA are overwritten below
    else:
        sdpa_fresh = plan.fresh_groups
        if plan.with_context:
            _attend_with_context(query, kv_cache, meta, plan.with_context, scale, out)
    if sdpa_fresh:
        key, value = as_stored(key, kv_cache.dtype), as_stored(value, kv_cache.dtype)
    for q_len, rows in sdpa_fresh.items():
        _attend_fresh(query, key, value, meta, q_len, rows, scale, out)
    return out


def _attend_with_context(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         rows: list[int], scale: float, out: torch.Tensor) -> None:
    """Portable path: decodes batched over K/V gathered through block tables, other chunks one by one."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    nd = meta.num_decodes
    if nd:
        seq_len = meta.max_decode_seq_len
        tables = meta.block_tables[:nd]
        k = gather_tokens(key_cache, tables, seq_len, query.dtype)  # [nd, Hkv, L, D]
        v = gather_tokens(value_cache, tables, seq_len, query.dtype)
        # GQA without copying K/V: the query heads of one KV group become G query rows.
        q = query[:nd].view(nd, num_kv_heads, group, head_dim)
        mask = torch.arange(seq_len, device=query.device)[None, :] < meta.seq_lens[:nd, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
        out[:nd] = o.reshape(nd, num_heads, head_dim)
    for i in rows:
        if i < nd:
            continue
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        q_len = end - start
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        table = meta.block_tables[i:i + 1]
        k = gather_tokens(key_cache, table, seq_len, query.dtype)[0]  # [Hkv, L, D]
        v = gather_tokens(value_cache, table, seq_len, query.dtype)[0]
        # Query j sits at position seq_len - q_len + j and sees keys up to and including itself.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[start:end] = o.transpose(0, 1)


def _attend_fresh(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata,
                  q_len: int, rows: list[int], scale: float, out: torch.Tensor) -> None:
    """Prompts with no earlier context, all of length q_len: causal attention over their own K/V."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    gqa = num_heads != num_kv_heads
    starts = [meta.query_start_loc_cpu[i] for i in rows]
    # 4-D [batch, heads, L, D] inputs throughout: torch's CPU SDPA takes a much slower path for 3-D ones
    # (one 2048-token prompt, one layer of the default model: 360 ms as [H, L, D] vs 58 ms as [1, H, L, D]).
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
    state_key = TORCH_STATE_KEY

    def _kernels(self, tensor: torch.Tensor) -> Any | None:
        """The C++ kernels for this step's tensors (the CPU backend's), or None: the portable path."""
        return None

    def build_state(self, meta: AttentionMetadata, specs: Collection[AttentionSpec]) -> TorchStepState:
        """The pieces the layers of ``specs`` will ask for: the paged plan (causal layers, and sliding ones
        this step is not longer than), the encoder's offsets or buckets, the kernel's cross-attention layout."""
        kernels = self._kernels(meta.seq_lens)
        if any(s.kind in ("causal", "sliding") and s.window_for(meta.max_seq_len) is None for s in specs):
            step_plan(meta)
        if any(s.kind == "encoder" for s in specs):
            prepare_encoder_state(meta, kernels)
        if kernels is not None and any(s.kind == "cross" for s in specs):
            cross_layout(meta)
        return torch_state(meta)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata, spec: AttentionSpec, scale: float) -> torch.Tensor:
        if spec.kind == "encoder":
            return encoder_attention(query, key, value, meta, scale, self._kernels(query))
        if spec.kind == "cross":
            return cross_attention(query, kv_cache, meta, scale, self._kernels(query))
        if kv_cache is None:
            raise RuntimeError("a causal or sliding-window attention layer has no KV cache bound")
        window = spec.window_for(meta.max_seq_len)
        if window is None:
            return paged_attention(query, key, value, kv_cache, meta, scale, self._kernels(query))
        write_kv(kv_cache, key, value, meta.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        sliding_window_attention(query, kv_cache, meta, window, scale, out)
        return out
