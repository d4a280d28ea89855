"""Paged attention for CUDA as one Triton kernel: decodes, prefill chunks with context and fresh prompts
alike read K/V in place through the block tables (no gather into contiguous copies).

One program handles one request, one KV head and a tile of that request's query tokens. The query heads
that share the KV head are folded into the tile's rows (row r = token r // G, head r % G for G query heads
per KV head), so a decode step still fills the rows of a matrix multiply and each K/V block is read once
per KV head, not once per query head. Scores use an online softmax over KV blocks (flash-attention style),
with a causal mask and an optional sliding window.

A decode-only step with few requests would leave most of a GPU idle (one program per request and KV head,
walking the whole context), so there the context is split (flash-decoding): ``NUM_SPLITS`` programs per
request and KV head each take a share of its blocks and write a partial result with its softmax statistics,
and a second kernel combines them. The split count depends only on the batch and the block table's width,
never on tensor values, so a captured CUDA graph stays valid for any context length.

On a machine without a GPU the same kernel runs under ``TRITON_INTERPRET=1`` (the tests do that against
the portable torch path).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.backends.paged_kv import is_fp8, write_kv
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.spec import AttentionSpec
from pagedllm.kernels.triton_ops import (
    interpreted,
    multiprocessors,
    next_pow2,
    splits_to_fill,
    target_arch,
    tl,
    triton,
)

# DOT_FP32: both dots take float32 operands at full precision ("ieee", not tf32): for a float32 cache, whose
# users expect float32 attention, and under the interpreter (triton_ops.interpreted), which multiplies bf16 as
# raw bits. Otherwise the dots take the cache's dtype on tensor cores.


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        scale, kv_scale_ptr,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_table, part_ptr, m_part_ptr, l_part_ptr, num_heads,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, NUM_SPLITS: tl.constexpr, FP8: tl.constexpr,
    ):
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
        if NUM_SPLITS == 1:
            q_tile = tl.program_id(2)
            split = 0
        else:  # a decode-only step split over the context: axis 2 is the share of the blocks
            q_tile = 0
            split = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        if q_tile * BLOCK_Q < q_len:
            seq_len = tl.load(seq_lens_ptr + req)
            context_len = seq_len - q_len

            rows = tl.arange(0, BLOCK_M)
            tok = q_tile * BLOCK_Q + rows // GROUP  # query token within the request
            head = kv_head * GROUP + rows % GROUP  # query head
            row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
            dims = tl.arange(0, BLOCK_D)
            dim_ok = dims < HEAD_DIM
            q_offsets = (q_start + tok).to(tl.int64)[:, None] * stride_q_tok + head[:, None] * stride_q_head
            q = tl.load(q_ptr + q_offsets + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
            if DOT_FP32:
                q = q.to(tl.float32)
            q_pos = context_len + tok  # absolute position of each row's token
            # An fp8 cache: rows widened in registers (exactly: every e4m3 / e5m2 value is a bf16 and a half), the
            # k scale folded into the scores' scale and the v scale into the output.
            qk_scale = scale
            v_scale = 1.0
            if FP8:
                qk_scale = scale * tl.load(kv_scale_ptr)
                v_scale = tl.load(kv_scale_ptr + 1)

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

            # Keys this tile can see: up to its last token (causal), from the window's start if any.
            last_tok = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
            end_block = (context_len + last_tok + BLOCK_SIZE - 1) // BLOCK_SIZE
            start_block = 0
            first_pos = 0
            if WINDOW > 0:
                first_pos = tl.maximum(context_len + q_tile * BLOCK_Q - WINDOW + 1, 0)
                start_block = first_pos // BLOCK_SIZE
            if NUM_SPLITS > 1:
                per_split = (end_block - start_block + NUM_SPLITS - 1) // NUM_SPLITS
                start_block = start_block + split * per_split
                end_block = tl.minimum(start_block + per_split, end_block)
            # BLOCK_N keys per iteration, gathered from as many cache blocks as they span.
            # Keys outside [first_pos, visible_end) are never loaded: the slots past a request's last token (or
            # before its window, or a freed block's null block) hold another request's data, maybe non-finite,
            # and 0 * NaN in the p @ V dot would poison the row.
            keys = tl.arange(0, BLOCK_N)
            end_pos = end_block * BLOCK_SIZE
            visible_end = context_len + last_tok
            for k_start in range(start_block * BLOCK_SIZE, end_pos, BLOCK_N):
                k_pos = k_start + keys
                key_ok = (k_pos < end_pos) & (k_pos < visible_end) & (k_pos >= first_pos)
                block_id = tl.load(block_tables_ptr + req * stride_table + k_pos // BLOCK_SIZE, mask=key_ok,
                                   other=0).to(tl.int64)
                in_block = k_pos % BLOCK_SIZE
                k = tl.load(k_cache_ptr + (block_id * stride_k_block + in_block * stride_k_slot
                                           + kv_head * stride_k_head)[:, None] + dims[None, :],
                            mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
                if FP8:
                    k = k.to(tl.float32).to(q.dtype)
                if DOT_FP32:
                    k = k.to(tl.float32)
                    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
                else:
                    scores = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale
                allowed = key_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
                if WINDOW > 0:
                    allowed = allowed & (k_pos[None, :] > q_pos[:, None] - WINDOW)
                scores = tl.where(allowed, scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                # A row that has seen no allowed key yet keeps -inf; shift by 0 so exp() gives 0, not NaN.
                m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(scores - m_shift[:, None])
                alpha = tl.exp(m_i - m_shift)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_cache_ptr + (block_id * stride_v_block + in_block * stride_v_slot
                                           + kv_head * stride_v_head)[:, None] + dims[None, :],
                            mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
                if FP8:
                    v = v.to(tl.float32).to(q.dtype)
                if DOT_FP32:
                    v = v.to(tl.float32)
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
                m_i = m_new
            acc = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            if NUM_SPLITS == 1:
                o_offsets = (q_start + tok).to(tl.int64)[:, None] * stride_o_tok + head[:, None] * stride_o_head
                tl.store(out_ptr + o_offsets + dims[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & dim_ok[None, :])
            else:  # this share's normalised output and its (max, sum) at [token, head, split]
                part = ((q_start + tok).to(tl.int64) * num_heads + head) * NUM_SPLITS + split
                tl.store(part_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                         mask=row_ok[:, None] & dim_ok[None, :])
                tl.store(m_part_ptr + part, m_i, mask=row_ok)
                tl.store(l_part_ptr + part, l_i, mask=row_ok)

    @triton.jit
    def _combine_splits_kernel(out_ptr, part_ptr, m_part_ptr, l_part_ptr, stride_o_tok, stride_o_head, num_heads,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        base = (tok * num_heads + head) * NUM_SPLITS
        splits = tl.arange(0, NUM_SPLITS)
        maxes = tl.load(m_part_ptr + base + splits)
        sums = tl.load(l_part_ptr + base + splits)
        # A share with no visible key has sum 0 (and max -inf): weight 0. Every decode sees at least itself.
        weight = tl.where(sums > 0.0, tl.exp(maxes - tl.max(maxes, 0)) * sums, 0.0)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        parts = tl.load(part_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :], mask=dim_ok[None, :],
                        other=0.0)
        out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dim_ok)


def tile_shape(group: int, max_query_len: int, head_dim: int = 64, fp32: bool = False) -> tuple[int, int]:
    """(BLOCK_M rows per program, BLOCK_Q query tokens per program) for G = ``group`` heads per KV head.

    Rows are tokens x heads of one KV group. Decode steps use 16 rows (the smallest ``tl.dot`` tile);
    steps with longer queries use 64 so fewer programs reload the same K/V, or 32 (16) where a bigger float32
    accumulator would spill registers on sm_90 (heads over 128 wide, float32 dots on FMA units; see
    tests/kernels/compile_kernels.py).
    """
    if max_query_len * group <= 16 or (fp32 and head_dim > 128):
        rows = 16
    else:
        rows = 32 if head_dim > 128 or (fp32 and head_dim > 64) else 64
    block_m = max(rows, next_pow2(group))
    return block_m, max(1, block_m // group)


# Flash-decoding: each share of a split context holds at least MIN_SPLIT_BLOCKS blocks; at most MAX_SPLITS shares.
MIN_SPLIT_BLOCKS, MAX_SPLITS = 8, 32


def decode_splits(num_programs: int, max_blocks: int, num_sms: int) -> int:
    """Shares to split each decode's context into: 1 when ``num_programs`` (requests x KV heads) already fill
    ``num_sms`` multiprocessors or the contexts (up to ``max_blocks`` blocks) are short."""
    return splits_to_fill(num_programs, num_sms, min(max_blocks // MIN_SPLIT_BLOCKS, MAX_SPLITS))


def keys_per_iteration(head_dim: int, block_m: int, fp32_dots: bool, arch: int = 90) -> int:
    """Keys (across cache blocks) one loop iteration of the attention kernel scores: 64 on tensor cores, fewer
    where the tile would spill registers (tests/kernels/compile_kernels.py): 32 for heads over 128 wide with
    32+ row tiles, or 128 wide with 64-row tiles before Hopper; 16 for float32 dots (FMA units, registers)."""
    if fp32_dots:
        return 16
    if (head_dim > 128 and block_m > 16) or (arch < 90 and head_dim >= 128 and block_m >= 64):
        return 32
    return 64



def triton_paged_attention(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                           kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           sliding_window: int = 0, num_splits: int | None = None,
                           kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """query: [T, H, D]; key/value: [T, Hkv, D] (this step's tokens) -> [T, H, D].

    Writes this step's K/V into ``kv_cache`` ([2, num_blocks, block_size, Hkv, D]) by ``meta.slot_mapping``
    (key/value None: the rotary kernel did), then every request attends through its block table.
    ``sliding_window`` > 0: each query sees only the last ``sliding_window`` positions (itself included).
    ``num_splits``: shares of each context in a decode-only step (a power of two; default ``decode_splits``).
    ``kv_scale``: an fp8 cache's [2] float32 k/v scales on the cache's device (None: 1.0), read by the kernel
    from memory (graph-safe).
    """
    if triton is None:
        raise RuntimeError("the Triton attention backend needs triton (it ships with CUDA builds of torch)")
    if query.stride(-1) != 1:
        raise ValueError("query's head dimension must be contiguous")
    fp8 = is_fp8(kv_cache.dtype)
    if fp8 and kv_scale is None:
        kv_scale = torch.ones(2, dtype=torch.float32, device=kv_cache.device)
    if key is not None:
        write_kv(kv_cache, key, value, meta.slot_mapping, kv_scale if fp8 else None)
    num_tokens, num_heads, head_dim = query.shape
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_query_len = meta.max_query_len
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    fp32_cache = kv_cache.dtype == torch.float32 or (fp8 and query.dtype == torch.float32)  # float32 dots
    block_m, block_q = tile_shape(group, max_query_len, head_dim, fp32_cache)
    if max_query_len != 1:
        num_splits = 1
    elif num_splits is None:
        max_blocks = meta.block_tables.shape[1]  # static under CUDA graphs: never a tensor's value
        if sliding_window > 0:
            max_blocks = min(max_blocks, sliding_window // block_size + 2)
        num_splits = decode_splits(meta.num_reqs * num_kv_heads, max_blocks, multiprocessors(query.device))
    if num_splits > 1:
        f32 = dict(dtype=torch.float32, device=query.device)
        part = torch.empty(num_tokens, num_heads, num_splits, head_dim, **f32)
        m_part = torch.empty(num_tokens, num_heads, num_splits, **f32)
        l_part = torch.empty(num_tokens, num_heads, num_splits, **f32)
        grid = (meta.num_reqs, num_kv_heads, num_splits)
    else:
        part = m_part = l_part = out  # unused
        grid = (meta.num_reqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale, kv_scale if fp8 else meta.seq_lens,  # (unread without FP8)
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        meta.block_tables.stride(0), part, m_part, l_part, num_heads,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_N=keys_per_iteration(head_dim, block_m, fp32_cache, target_arch(query.device)),
        BLOCK_M=block_m, BLOCK_Q=block_q,
        WINDOW=max(0, int(sliding_window)), DOT_FP32=fp32_cache or interpreted(), NUM_SPLITS=num_splits,
        FP8=fp8,
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            out, part, m_part, l_part, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), NUM_SPLITS=num_splits)
    return out


# Layers the Triton backend hands to its fallback (the portable torch path).
FALLBACK_KINDS = ("encoder", "cross")


class TritonPagedAttentionBackend(AttentionBackend):
    """CUDA: causal and sliding-window layers through the Triton kernel; encoder layers (no cache) and
    cross-attention layers through the portable torch path. Graph-safe: it reads no tensor values on the host."""

    name = "triton"
    graph_safe = True

    def __init__(self, fallback: AttentionBackend) -> None:
        self.fallback = fallback

    def takes_kv_from_rotary(self, qkv: torch.Tensor) -> bool:
        return True

    def prepare_step(self, meta: AttentionMetadata, specs: Collection[AttentionSpec]) -> None:
        """The kernel keeps no per-step state (its launch shape is worked out per call, from the batch and the
        table's width); the layers it hands to the fallback get the fallback's."""
        self.fallback.prepare_step(meta, [s for s in specs if s.kind in FALLBACK_KINDS])

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor | None, meta: AttentionMetadata, spec: AttentionSpec,
                scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        if spec.kind in FALLBACK_KINDS or kv_cache is None:
            return self.fallback.forward(query, key, value, kv_cache, meta, spec, scale)
        window = spec.window if spec.kind == "sliding" else 0
        return triton_paged_attention(query, key, value, kv_cache, meta, scale, sliding_window=window or 0,
                                      kv_scale=kv_scale)
