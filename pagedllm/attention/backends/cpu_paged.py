"""The CPU backend: ``TorchPagedAttentionBackend`` with the C++ kernels where they apply, and the routing of a
step's requests between them and the portable path. The paged kernel serves decodes and chunks with earlier
context of up to ``CONTEXT_CHUNK_KERNEL_MAX_LEN`` tokens (later prefill chunks, prefix hits) and fresh prompts of
up to ``FRESH_PROMPT_KERNEL_MAX_LEN`` (shorter limits for bf16 queries: ``kernel_limits``), reading K/V through
the block tables in place, and stores every K/V (``write_kv``). Prompts past the paged kernel's lengths, fresh or
with context, go to the causal ``encoder_attention`` kernels instead of SDPA where they are faster
(``_causal_kernel``): in float32 with kernels built for AVX-512, in bf16 on CPUs with AVX-512 BF16 and no AMX
tiles. The encoder kernel attends each (sequence, head) of an encoder layer in place. What the kernels do not take
(longer chunks and prompts, the sliding window's long steps) goes through the portable torch path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm import envs
from pagedllm.attention.backends.paged_kv import as_stored, gather_tokens, is_fp8, kv_scale_of
from pagedllm.attention.backends.torch_encoder import bf16_kernel
from pagedllm.attention.backends.torch_sdpa import (
    AttentionPlan,
    TorchPagedAttentionBackend,
    attend_chunks,
    attend_fresh_groups,
    step_plan,
)
from pagedllm.attention.backends.torch_sdpa import paged_attention as portable_paged_attention
from pagedllm.attention.key_rotation import KeyRotation
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.platforms import platform_of


@dataclass
class KernelSplit:
    """A step's requests between the paged CPU kernel and the rest: ``kernel_rows`` (int32, or None if none), the
    fresh prompts past its length by query length, and the requests with context whose chunks are past its length
    (both for the causal kernels where they are faster, ``_causal_kernel``, else SDPA)."""

    kernel_rows: torch.Tensor | None
    long_fresh: dict[int, list[int]]
    long_chunks: list[int]


def kernel_split(plan: AttentionPlan, max_fresh_len: int, max_chunk_len: int) -> KernelSplit:
    """The step's requests (``plan``) between the paged kernel, which takes fresh prompts of up to ``max_fresh_len``
    tokens and chunks with context of up to ``max_chunk_len``, and the rest. Memoized in the plan, since every
    layer asks the same."""
    key = ("kernel_split", max_fresh_len, max_chunk_len)
    if key not in plan.memo:
        rows = [i for i in plan.with_context if plan.query_lens[i] <= max_chunk_len]
        chunks = [i for i in plan.with_context if plan.query_lens[i] > max_chunk_len]
        kept = len(rows) == len(plan.with_context)
        rest: dict[int, list[int]] = {}
        for q_len, group in plan.fresh_groups.items():
            if q_len <= max_fresh_len:
                rows.extend(group)
                kept = False
            else:
                rest[q_len] = group
        if not rows:
            tensor = None
        elif kept:
            tensor = plan.with_context_tensor
        else:
            tensor = torch.tensor(sorted(rows), dtype=torch.int32, device=plan.with_context_tensor.device)
        plan.memo[key] = KernelSplit(tensor, rest, chunks)
    return plan.memo[key]


# Longest fresh prompt the paged CPU kernel attends; beyond it SDPA's blocked matmuls (or the causal kernels,
# ``_causal_kernel``) are faster (the crossover: docs/performance.md).
FRESH_PROMPT_KERNEL_MAX_LEN = 256
# Longest chunk with earlier context (a later prefill chunk, a prefix-cache hit's rest) the paged kernel attends;
# longer ones go to SDPA (or the causal kernels) over K/V gathered from the cache, whose blocked matmuls reuse each
# key across query rows; at 8-16 tokens the kernel is faster (the crossover: docs/performance.md).
CONTEXT_CHUNK_KERNEL_MAX_LEN = 128
# The limits for a bf16 query on a CPU with native bf16 (oneDNN's: AMX or AVX512-BF16), where SDPA's blocked bf16
# matmuls win from shorter queries; at 64 tokens the SDPA path's host work makes the two about even (measured on AMX
# tiles: docs/performance.md).
BF16_FRESH_PROMPT_KERNEL_MAX_LEN = 64
BF16_CONTEXT_CHUNK_KERNEL_MAX_LEN = 32


def kernel_limits(query: torch.Tensor) -> tuple[int, int]:
    """(longest fresh prompt, longest chunk with context) the CPU kernel attends for queries like ``query``."""
    if query.dtype == torch.bfloat16 and platform_of(query).onednn_bf16():
        return BF16_FRESH_PROMPT_KERNEL_MAX_LEN, BF16_CONTEXT_CHUNK_KERNEL_MAX_LEN
    return FRESH_PROMPT_KERNEL_MAX_LEN, CONTEXT_CHUNK_KERNEL_MAX_LEN


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    kernels: Any | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """query: [T, H, D]; key/value: [T, Hkv, D] (this step's new tokens) -> output [T, H, D].

    K/V of this step are written to the cache first. The paged kernel takes decodes, short chunks and short fresh
    prompts (reading their K/V back from the cache while it is hot); longer ones go to the causal kernels or
    SDPA's blocked matmuls. Without ``kernels`` the portable path (``torch_sdpa.paged_attention``) serves it all.
    An fp8 cache (``kv_scale``: its [2] k/v scales) is read by the paged kernel in place; the causal kernels take
    long prompts and chunks over K/V rounded as stored and widened to the query's dtype.
    """
    if kernels is None:
        return portable_paged_attention(query, key, value, kv_cache, meta, scale, kv_scale)
    fp8 = is_fp8(kv_cache.dtype)
    if not fp8:
        kv_scale = None  # only an fp8 cache has scales
    kernels.write_kv(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping, kv_scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # query may be a strided view
    split = kernel_split(step_plan(meta), *kernel_limits(query))
    kernel_rows, fresh_left = split.kernel_rows, split.long_fresh
    if split.long_chunks:
        chunk_kernel = _causal_kernel(kernels, query)
        if chunk_kernel is not None:
            _attend_chunks_in_kernel(query, kv_cache, meta, split.long_chunks, scale, out, kernels, chunk_kernel,
                                     kv_scale)
        else:
            attend_chunks(query, kv_cache, meta, split.long_chunks, scale, out, kv_scale)
    if kernel_rows is not None:
        # float32, or bf16 with a bf16 or fp8 cache (the kernel widens each token's query itself); any other
        # query goes through float32 copies.
        native = query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and
                                                  (fp8 or kv_cache.dtype == torch.bfloat16))
        q_in = query if native else query.float()
        if not _heads_contiguous(q_in):
            q_in = q_in.contiguous()  # the kernel reads each token's heads as one row (views of a fused qkv do)
        out_k = out if native else torch.empty_like(q_in)
        kernels.paged_attention(q_in, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, out_k, scale, kernel_rows, kv_scale=kv_scale)
        if out_k is not out:
            out.copy_(out_k)  # rows left to the other paths are overwritten below
    if fresh_left:
        stored_key = as_stored(key, kv_cache.dtype, kv_scale_of(kv_scale, 0))
        stored_value = as_stored(value, kv_cache.dtype, kv_scale_of(kv_scale, 1))
        prompt_kernel = _causal_kernel(kernels, query, stored_key, stored_value)
        if prompt_kernel is not None:
            _attend_fresh_in_kernel(query, stored_key, stored_value, meta, fresh_left, scale, out, kernels,
                                    prompt_kernel)
            return out
    attend_fresh_groups(query, key, value, kv_cache, meta, fresh_left, scale, out, kv_scale)
    return out


def _heads_contiguous(t: torch.Tensor) -> bool:
    """Whether each token's heads of t [T, H, D] lie in one contiguous row, as the C++ kernels read them (views of
    a fused projection have them)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _causal_kernel(kernels: Any, query: torch.Tensor, *kv: torch.Tensor) -> str | None:
    """The ``encoder_attention`` kernel that attends ``query``'s long prompts and chunks causally here, or None: SDPA.

    float32: the generic kernel where it is built for AVX-512 (blocks of 8 rows x 16 keys, skipping the keys past
    each block's last row), faster than SDPA on fresh prompts and chunks with context alike. Built for AVX2 (blocks
    of 4 rows) it is slower: with torch, MKL and the kernels held to AVX2 it lost to SDPA from 2,048 tokens on, so
    there SDPA keeps them (``PAGEDLLM_PROMPT_ATTENTION_FLOAT32`` forces either path; figures: docs/performance.md).
    bf16: the dot-product kernel where the CPU has one and no AMX tiles (``bf16_kernel``). The kernel reads the
    query (and ``kv``, a fresh prompt's own K/V; a chunk's are gathered in the query's dtype) in place: each token's
    heads must be contiguous, as views of a fused projection have them, and K/V must be in the query's dtype."""
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
                             scale: float, out: torch.Tensor, kernels: Any, kernel: str,
                             kv_scale: torch.Tensor | None = None) -> None:
    """Requests ``rows`` with earlier context (long later chunks, long rests of prefix-cache hits) through the C++
    causal attention kernel (``kernel``), one call each over K/V gathered through its block table: its q_len queries
    are the last q_len of its seq_len positions. Faster than SDPA with the chunk's mask (figures:
    docs/performance.md)."""
    qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i in rows:
        start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
        table = meta.block_tables[i:i + 1]
        # [L, Hkv, D], each token's heads contiguous (a view of the gathered blocks)
        k, v = (gather_tokens(kv_cache[c], table, seq_len, query.dtype, kv_scale_of(kv_scale, c))[0].transpose(0, 1)
                for c in (0, 1))
        offsets = torch.tensor([0, end - start], dtype=torch.int32)
        key_offsets = torch.tensor([0, seq_len], dtype=torch.int32)
        out[start:end] = kernels.encoder_attention(query[start:end], k, v, offsets, scale, kernel, True, key_offsets)


class CpuPagedAttentionBackend(TorchPagedAttentionBackend):
    name = "cpu"
    records_step_graphs = True

    def __init__(self) -> None:
        kernels = load_cpu_kernels()
        if kernels is None:
            raise ValueError("attention_backend: 'cpu' needs the C++ CPU kernels, which could not be built or "
                             "loaded here (see the warning above); use 'torch'")
        self.kernels = kernels

    def _kernels(self, tensor: torch.Tensor) -> Any | None:
        return self.kernels

    def rotate_heads_(self, x: torch.Tensor, rotation: KeyRotation, which: str) -> None:
        """The C++ fast Walsh-Hadamard transform (a recorded kernel: step graphs keep it) for float32 / bf16 heads
        with contiguous elements; the portable matmul otherwise."""
        if x.dtype in (torch.float32, torch.bfloat16) and x.stride(2) == 1:
            self.kernels.hadamard_heads_(x, rotation.block, rotation.scale(which))
        else:
            super().rotate_heads_(x, rotation, which)

    def _paged_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, kv_scale: torch.Tensor | None) -> torch.Tensor:
        return paged_attention(query, key, value, kv_cache, meta, scale, self.kernels, kv_scale)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
        self.kernels.write_kv(key, value, kv_cache[0], kv_cache[1], slot_mapping,
                              kv_scale if is_fp8(kv_cache.dtype) else None)
