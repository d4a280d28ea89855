"""Paged attention: torch SDPA for fresh prompts, and for requests with earlier context either the C++
CPU kernel (reads K/V through block tables in place; decodes and short chunks) or SDPA over K/V gathered
through the block tables (the portable path). On the CPU, prompts past the paged kernel's lengths, fresh or with
context, go to the causal ``encoder_attention`` kernels instead of SDPA where they are faster (``_causal_kernel``):
in float32 with kernels built for AVX-512, in bf16 on CPUs with AVX-512 BF16 and no AMX tiles. The portable path
is the reference and serves CUDA.
Sliding-window layers go through ``torch_windowed``, encoder layers through ``torch_encoder``, cross-attention
layers through ``cross_attention``; ``TorchPagedAttentionBackend`` routes by the layer's spec.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.backends.cross_attention import cross_attention, cross_layout
from pagedllm.attention.backends.paged_kv import as_stored, gather_tokens, write_kv
from pagedllm.attention.backends.torch_encoder import bf16_kernel, encoder_attention, prepare_encoder_state
from pagedllm.attention.backends.torch_state import TORCH_STATE_KEY, TorchStepState, torch_state
from pagedllm.attention.backends.torch_windowed import sliding_window_attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec
from pagedllm.platforms import platform_of


@dataclass
class KernelSplit:
    """A step's requests between the paged CPU kernel and the rest: ``kernel_rows`` (int32, or None if none), the
    fresh prompts past its length by query length, and the requests with context whose chunks are past its length
    (both for the causal kernels where they are faster, ``_causal_kernel``, else SDPA)."""

    kernel_rows: torch.Tensor | None
    long_fresh: dict[int, list[int]]
    long_chunks: list[int]


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
    _kernel_splits: dict[tuple[int, int], KernelSplit] = field(default_factory=dict)
    _chunk_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def kernel_split(self, max_fresh_len: int, max_chunk_len: int) -> KernelSplit:
        """For a backend whose kernel takes fresh prompts of up to ``max_fresh_len`` tokens and chunks with
        context of up to ``max_chunk_len``: who goes where. Memoized, since every layer asks the same."""
        key = (max_fresh_len, max_chunk_len)
        if key not in self._kernel_splits:
            rows = [i for i in self.with_context if self.query_lens[i] <= max_chunk_len]
            chunks = [i for i in self.with_context if self.query_lens[i] > max_chunk_len]
            kept = len(rows) == len(self.with_context)
            rest: dict[int, list[int]] = {}
            for q_len, group in self.fresh_groups.items():
                if q_len <= max_fresh_len:
                    rows.extend(group)
                    kept = False
                else:
                    rest[q_len] = group
            if not rows:
                tensor = None
            elif kept:
                tensor = self.with_context_tensor
            else:
                tensor = torch.tensor(sorted(rows), dtype=torch.int32, device=self.with_context_tensor.device)
            self._kernel_splits[key] = KernelSplit(tensor, rest, chunks)
        return self._kernel_splits[key]

    def chunk_mask(self, i: int, meta: AttentionMetadata) -> torch.Tensor:
        """[q_len, seq_len] bool for request i with context: its query j sits at position seq_len - q_len + j and
        sees keys up to and including itself. Built once per step: every layer asks."""
        mask = self._chunk_masks.get(i)
        if mask is None:
            seq_len, device = meta.seq_lens_cpu[i], meta.seq_lens.device
            q_pos = torch.arange(seq_len - self.query_lens[i], seq_len, device=device)
            mask = self._chunk_masks[i] = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        return mask


def step_plan(meta: AttentionMetadata) -> AttentionPlan:
    """The step's plan (built once per step: by ``build_state``, else by the first layer that asks)."""
    state = torch_state(meta)
    if state.paged_plan is None:
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        fresh: dict[int, list[int]] = {}
        other: list[int] = []
        query_lens = [qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)]
        for i, q_len in enumerate(query_lens):
            if q_len > 1 and seq_lens[i] == q_len:
                fresh.setdefault(q_len, []).append(i)
            else:
                other.append(i)
        state.paged_plan = AttentionPlan(fresh, other, torch.tensor(other, dtype=torch.int32,
                                                                    device=meta.seq_lens.device), query_lens)
    return state.paged_plan


# Longest fresh prompt the paged CPU kernel attends; beyond it SDPA's blocked matmuls (or the causal kernels,
# ``_causal_kernel``) are faster. One layer of the default model, 2 cores: 16 x 128 tokens 9.5 ms (kernel) vs 13.2 ms
# (SDPA); 4 x 512: 27.6 vs 24.3; 2 x 1024: 66 vs 31.
FRESH_PROMPT_KERNEL_MAX_LEN = 256
# Longest chunk with earlier context (a later prefill chunk, a prefix-cache hit's rest) the paged kernel attends;
# longer ones go to SDPA (or the causal kernels) over K/V gathered from the cache, whose blocked matmuls reuse each
# key across query rows. One request, one layer of the default model (Intel Xeon, 2 cores), kernel vs SDPA: float32
# 64 tokens over 1,024 1.2 vs 0.9 ms, 128 over 512 1.0 vs 0.8, 952 over 3,000 60 vs 27; bf16 128 over 512 1.1 vs 0.4,
# 952 over 3,000 45 vs 12.5; at 8-16 tokens the kernel is faster.
CONTEXT_CHUNK_KERNEL_MAX_LEN = 128
# The limits for a bf16 query on a CPU with native bf16 (oneDNN's: AMX or AVX512-BF16), where SDPA's blocked bf16
# matmuls win from shorter queries. One layer of the default model (Intel Xeon with AMX, 2 cores), kernel vs SDPA:
# one fresh prompt of 64 tokens 0.07 vs 0.06 ms (the SDPA path's host work makes that even), 128 0.23 vs 0.10,
# 16 prompts x 128 3.4 vs 1.35; a chunk of 32 tokens over 1,024 keys 0.7 vs 0.5, of 64 1.4 vs 0.6.
BF16_FRESH_PROMPT_KERNEL_MAX_LEN = 64
BF16_CONTEXT_CHUNK_KERNEL_MAX_LEN = 32


def kernel_limits(query: torch.Tensor) -> tuple[int, int]:
    """(longest fresh prompt, longest chunk with context) the CPU kernel attends for queries like ``query``."""
    if query.dtype == torch.bfloat16 and platform_of(query).onednn_bf16():
        return BF16_FRESH_PROMPT_KERNEL_MAX_LEN, BF16_CONTEXT_CHUNK_KERNEL_MAX_LEN
    return FRESH_PROMPT_KERNEL_MAX_LEN, CONTEXT_CHUNK_KERNEL_MAX_LEN


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
        # The kernel takes decodes, short chunks and short fresh prompts (reading their K/V back from the cache
        # while it is hot); longer ones go to the causal kernels or SDPA's blocked matmuls.
        split = plan.kernel_split(*kernel_limits(query))
        kernel_rows, fresh_left = split.kernel_rows, split.long_fresh
        if split.long_chunks:
            chunk_kernel = _causal_kernel(kernels, query)
            if chunk_kernel is not None:
                _attend_chunks_in_kernel(query, kv_cache, meta, split.long_chunks, scale, out, kernels, chunk_kernel)
            else:
                _attend_chunks(query, kv_cache, meta, split.long_chunks, scale, out)
        if kernel_rows is not None:
            # float32, or bf16 with a bf16 cache (the kernel widens each token's query itself); any other
            # query goes through float32 copies.
            native = query.dtype == torch.float32 or query.dtype == kv_cache.dtype == torch.bfloat16
            q_in = query if native else query.float()
            if not _heads_contiguous(q_in):
                q_in = q_in.contiguous()  # the kernel reads each token's heads as one row (views of a fused qkv do)
            out_k = out if native else torch.empty_like(q_in)
            kernels.paged_attention(q_in, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, out_k, scale, kernel_rows)
            if out_k is not out:
                out.copy_(out_k)  # rows left to the other paths are overwritten below
    else:
        fresh_left = plan.fresh_groups
        if plan.with_context:
            _attend_with_context(query, kv_cache, meta, plan.with_context, scale, out)
    if fresh_left:
        key, value = as_stored(key, kv_cache.dtype), as_stored(value, kv_cache.dtype)
        prompt_kernel = _causal_kernel(kernels, query, key, value) if kernels is not None else None
        if prompt_kernel is not None:
            _attend_fresh_in_kernel(query, key, value, meta, fresh_left, scale, out, kernels, prompt_kernel)
            return out
    for q_len, rows in fresh_left.items():
        _attend_fresh(query, key, value, meta, q_len, rows, scale, out)
    return out


def _heads_contiguous(t: torch.Tensor) -> bool:
    """Whether each token's heads of t [T, H, D] lie in one contiguous row, as the C++ kernels read them (views of
    a fused projection have them)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _causal_kernel(kernels: Any, query: torch.Tensor, *kv: torch.Tensor) -> str | None:
    """The ``encoder_attention`` kernel that attends ``query``'s long prompts and chunks causally here, or None: SDPA.

    float32: the generic kernel where it is built for AVX-512 (blocks of 8 rows x 16 keys, skipping the keys past
    each block's last row). Against SDPA (AMD Zen 4, 2 threads, one layer of the default model): fresh prompts of
    512 tokens 2.1 vs 4.0 ms, 2,048 32 vs 40, 4,096 126 vs 140; a chunk of 1,024 over 1,024 of context 24 vs 36, of
    2,048 over 2,048 91 vs 159. Built for AVX2 (blocks of 4 rows) it is slower: on the same CPU with torch, MKL
    and the kernels held to AVX2 it lost from 2,048 tokens on (58 vs 39 ms; a chunk of 2,048 over 6,144 466 vs
    307), so there SDPA keeps them (``PAGEDLLM_PROMPT_ATTENTION_FLOAT32`` forces either path). bf16: the
    dot-product kernel where the CPU has one and no AMX tiles (``bf16_kernel``). The kernel reads the query (and
    ``kv``, a fresh prompt's own K/V; a chunk's are gathered in the query's dtype) in place: each token's heads must
    be contiguous, as views of a fused projection have them, and K/V must be in the query's dtype."""
    if any(t.dtype != query.dtype for t in kv) or \
            not all(_heads_contiguous(t) for t in (query, *kv)):
        return None
    if query.dtype == torch.float32:
        choice = envs.PAGEDLLM_PROMPT_ATTENTION_FLOAT32
        return "generic" if choice == "kernel" or (choice == "auto" and kernels.built_for_avx512) else None
    return bf16_kernel(kernels, query, causal=True)


def _attend_fresh_in_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata,
                            fresh: dict[int, list[int]], scale: float, out: torch.Tensor, kernels: Any,
                            kernel: str) -> None:
    """Fresh prompts of any lengths through the C++ causal attention kernel (``kernel``, see _causal_kernel):
    one call per run of requests adjacent in the flat batch, q/k/v read in place (each token's heads contiguous, as
    views of a fused projection have them)."""
    qsl = meta.query_start_loc_cpu
    rows = sorted(i for group in fresh.values() for i in group)
    runs, current = [], [rows[0]]
    for i in rows[1:]:
        if i == current[-1] + 1:
            current.append(i)
        else:
            runs.append(current)
            current = [i]
    runs.append(current)
    for run in runs:
        start, end = qsl[run[0]], qsl[run[-1] + 1]
        offsets = torch.tensor([qsl[i] - start for i in run] + [end - start], dtype=torch.int32)
        out[start:end] = kernels.encoder_attention(query[start:end], key[start:end], value[start:end], offsets, scale,
                                                   kernel, True)


def _attend_chunks_in_kernel(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, rows: list[int],
                             scale: float, out: torch.Tensor, kernels: Any, kernel: str) -> None:
    """Requests ``rows`` with earlier context (long later chunks, long rests of prefix-cache hits) through the C++
    causal attention kernel (``kernel``), one call each over K/V gathered through its block table: its q_len queries
    are the last q_len of its seq_len positions. Against SDPA with the chunk's mask (AMD Zen 4, 2 threads, one layer
    of the default model in bf16): 2,048 queries over 4,096 keys 39.5 against 146 ms, 256 over 1,280 1.8 against
    5.7 ms."""
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i in rows:
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        table = meta.block_tables[i:i + 1]
        # [L, Hkv, D], each token's heads contiguous (a view of the gathered blocks)
        k, v = (gather_tokens(kv_cache[c], table, seq_len, query.dtype)[0].transpose(0, 1) for c in (0, 1))
        offsets = torch.tensor([0, end - start], dtype=torch.int32)
        key_offsets = torch.tensor([0, seq_len], dtype=torch.int32)
        out[start:end] = kernels.encoder_attention(query[start:end], k, v, offsets, scale, kernel, True, key_offsets)


def _attend_with_context(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         rows: list[int], scale: float, out: torch.Tensor) -> None:
    """Portable path: the step's decodes batched, the other requests in ``rows`` one by one."""
    if meta.num_decodes:
        _attend_decodes(query, kv_cache, meta, scale, out)
    chunks = [i for i in rows if i >= meta.num_decodes]
    if chunks:
        _attend_chunks(query, kv_cache, meta, chunks, scale, out)


def _attend_decodes(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor) -> None:
    """Portable path: the step's decodes (its first ``num_decodes`` requests) in one SDPA call over K/V gathered
    through their block tables."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    nd = meta.num_decodes
    seq_len = meta.max_decode_seq_len
    tables = meta.block_tables[:nd]
    k = gather_tokens(kv_cache[0], tables, seq_len, query.dtype)  # [nd, Hkv, L, D]
    v = gather_tokens(kv_cache[1], tables, seq_len, query.dtype)
    # GQA without copying K/V: the query heads of one KV group become G query rows.
    q = query[:nd].view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = torch.arange(seq_len, device=query.device)[None, :] < meta.seq_lens[:nd, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    out[:nd] = o.reshape(nd, num_heads, head_dim)


def _attend_chunks(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, rows: list[int],
                   scale: float, out: torch.Tensor) -> None:
    """Requests ``rows`` with earlier context (none a decode), one SDPA call each over K/V gathered through
    its block table: the portable path's, and the CPU backend's for long chunks."""
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[-2]
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    plan = step_plan(meta)
    for i in rows:
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]: 4-D (see _attend_fresh)
        table = meta.block_tables[i:i + 1]
        k = gather_tokens(kv_cache[0], table, seq_len, query.dtype)  # [1, Hkv, L, D]
        v = gather_tokens(kv_cache[1], table, seq_len, query.dtype)
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

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        kernels = self._kernels(key)
        if kernels is not None:
            kernels.write_kv(key, value, kv_cache[0], kv_cache[1], slot_mapping)
        else:
            write_kv(kv_cache, key, value, slot_mapping)

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
