"""A mixture-of-experts layer's experts for CUDA as Triton kernels: one grouped matmul launch per projection over
the step's rows sorted by expert, and a combine that sums each token's k expert outputs back in slot order.

Rows are sorted by expert (``fused_moe/grouping.py``: expert e owns sorted rows ``ends[e-1]:ends[e]``). The grouped
matmul tiles each expert's run of rows by BLOCK_M (``expert_tiles``): tile i multiplies rows [start, end) of one
expert by that expert's weight only, so a decode step reads the k chosen experts and no others. The tile map is
built on the device from ``ends`` with no host synchronisation, and the grid has a fixed size for a fixed number of
rows (``cdiv(R, BLOCK_M) + E`` tiles, enough however the rows fall; tiles past the last expert's read nothing), so
a CUDA graph can record the launch.

Weights: float stacks [E, N, K] (float32 / bf16 / fp16), or quantized rows stacked per expert in the dense
weight-only kernel's layouts (``triton_quant_matmul``: int8, 4-bit with minimums, fp8 e4m3; scales [E, N, G]),
dequantized tile by tile in registers by the same ``dequantized_tile``. The first projection reads the token rows
through the sort's ``token_of`` (no gathered copy of x); a bias [E, N] is added per row by its expert.

The combine reads, for token t and slot s, the sorted row that (t, s) became and adds weight * y in a fixed order
(no atomics): the same sums for a token whatever the batch holds, and the same from run to run. Rows at or past
``num_rows`` (other ranks' experts under expert parallelism) add nothing.

Tested through Triton's interpreter on the CPU (tests/kernels/test_triton_moe.py), compiled for sm_90 / sm_80 by
tests/kernels/compile_kernels.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.kernels.triton_ops import interpreted, next_pow2, target_arch
from pagedllm.kernels.triton_quant_matmul import block_k_for

try:
    import triton
    import triton.language as tl

    from pagedllm.kernels.triton_quant_matmul import dequantized_tile
except ImportError:  # pragma: no cover - the CPU build of torch ships no triton
    triton = None
    tl = None

#: ``moe_grouped_matmul``'s ``kind`` for float weights (the quantized kinds are ``triton_quant_matmul.KIND_*``).
KIND_FLOAT = -1

if triton is not None:

    @triton.jit
    def _moe_gemm_kernel(a_ptr, rows_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, y_ptr, tile_expert_ptr, tile_start_ptr,
                         tile_end_ptr, N, K, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be,
                         stride_ym, group, KIND: tl.constexpr, GATHER: tl.constexpr, HAS_BIAS: tl.constexpr,
                         DOT_HALF: tl.constexpr, FP8_NATIVE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        tile = tl.program_id(0)
        expert = tl.load(tile_expert_ptr + tile)
        live = expert >= 0
        expert = tl.where(live, expert, 0).to(tl.int64)
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        offs_m = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_ok = offs_m < end  # a tile past the last expert's has start = end = 0
        if GATHER:  # the sorted row's token: x is read in place
            a_rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
        else:
            a_rows = offs_m
        offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        n_ok = offs_n < N
        w_expert = w_ptr + expert * stride_we
        k_end = tl.where(live, K, 0)  # a tile past the last expert's reads nothing
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            if KIND < 0:
                w = tl.load(w_expert + offs_n[:, None] * stride_wn + offs_k[None, :],
                            mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            else:
                w = dequantized_tile(w_expert, s_ptr + expert * stride_se, mn_ptr + expert * stride_se, offs_n,
                                     offs_k, n_ok, k_ok, stride_wn, stride_sn, k0 // group, KIND, FP8_NATIVE)
            if DOT_HALF:  # bf16 / fp16 rows: tensor-core products in their own dtype, float32 sums
                half = a_ptr.dtype.element_ty
                acc += tl.dot(a.to(half), tl.trans(w.to(half)))
            else:
                acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _moe_combine_kernel(y_ptr, slot_rows_ptr, weight_ptr, out_ptr, H, num_rows, stride_y, stride_out,
                            TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for slot in tl.static_range(TOP_K):  # slot order: the same sum for the token whatever the batch
            row = tl.load(slot_rows_ptr + token * TOP_K + slot)
            here = row < num_rows
            row = tl.where(here, row, 0)
            w = tl.load(weight_ptr + row)
            y = tl.load(y_ptr + row * stride_y + offs_h, mask=offs_h < tl.where(here, H, 0), other=0.0)
            y = y.to(tl.float32)
            acc += tl.where(here, w, 0.0) * y
        tl.store(out_ptr + token * stride_out + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


@dataclass(frozen=True)
class ExpertTiles:
    """The grouped matmul's tiles over R rows sorted by expert, built on the device: tile i covers sorted rows
    ``start[i]:end[i]`` (at most ``block_m``) of expert ``expert[i]``; -1 past the last expert's tiles.
    ``expert`` / ``start`` / ``end``: int32 [cdiv(R, block_m) + E]."""

    expert: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    block_m: int

    @property
    def num_tiles(self) -> int:
        return self.expert.numel()


def block_m_for(num_rows: int, num_experts: int) -> int:
    """Rows per tile: 16 (tl.dot's least) when the experts average a few rows each (decode), 64 for prefills."""
    return 16 if num_rows <= 16 * num_experts else 64


def expert_tiles(ends: torch.Tensor, num_rows: int, block_m: int) -> ExpertTiles:
    """ends int32 [E] (expert e owns sorted rows ends[e-1]:ends[e]) -> the tiles of ``block_m`` rows, no host
    synchronisation; ``num_rows`` = ends[-1] as the host knows it (T * k)."""
    num_experts = ends.numel()
    ends64 = ends.to(torch.int64)
    counts = torch.diff(ends64, prepend=ends64.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    index = torch.arange(-(-num_rows // block_m) + num_experts, device=ends.device)
    expert = torch.searchsorted(tile_ends, index, right=True)
    live = expert < num_experts
    owner = expert.clamp(max=num_experts - 1)
    start = ends64[owner] - counts[owner] + (index - tile_ends[owner] + tiles[owner]) * block_m
    return ExpertTiles(torch.where(live, expert, -1).to(torch.int32), torch.where(live, start, 0).to(torch.int32),
                       torch.where(live, ends64[owner], 0).to(torch.int32), block_m)


@dataclass(frozen=True)
class StackedRows:
    """One projection of every expert in a weight-only kernel's row layout: ``qweight`` [E, N, Kq] (int8, 4-bit
    pairs or fp8 bytes), ``scales`` (and 4-bit ``mins``) float32 [E, N, G]; ``kind``: ``triton_quant_matmul.KIND_*``."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    kind: int
    group: int
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)


def moe_grouped_matmul(a: torch.Tensor, weight: torch.Tensor | StackedRows, tiles: ExpertTiles, num_rows: int,
                       token_of: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each sorted row times its expert's weight: [R, N] in a's dtype.

    a: [R, K] rows sorted by expert, or with ``token_of`` ([R] int64, each sorted row's token) the tokens
    [T, K] themselves. weight: float [E, N, K] in a's dtype, or ``StackedRows``. bias: [E, N] or None.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    if a.stride(-1) != 1:
        a = a.contiguous()
    if isinstance(weight, StackedRows):
        kind, n, k = weight.kind, weight.out_features, weight.in_features
        q, scales, mins, group = weight.qweight, weight.scales, weight.mins, weight.group
        stride_se, stride_sn = scales.stride(0), scales.stride(1)
    else:
        if weight.dtype != a.dtype:
            raise ValueError(f"moe_grouped_matmul: weight {weight.dtype}, rows {a.dtype}")
        kind, (n, k) = KIND_FLOAT, weight.shape[1:]
        q, scales, mins, group, stride_se, stride_sn = weight, weight, None, k, 0, 0
    if a.shape[1] != k or (bias is not None and bias.shape[1] != n):
        raise ValueError(f"moe_grouped_matmul: rows [{a.shape[1]}] against a weight of {k} inputs / {n} outputs")
    y = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return y
    dot_half = a.dtype in (torch.bfloat16, torch.float16) and not interpreted()
    if dot_half:
        block_n, block_k = 64, (block_k_for(group, k) if kind != KIND_FLOAT else 64)
    else:  # float32 dots from registers: tiles that do not spill (as the dense weight-only kernel's)
        block_n, block_k = 32, (16 if kind == KIND_FLOAT else min(16, block_k_for(group, k)))
    grid = (tiles.num_tiles, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, token_of if token_of is not None else tiles.start, q, scales, mins if mins is not None else scales,
        bias if bias is not None else scales, y, tiles.expert, tiles.start, tiles.end, n, k, a.stride(0),
        q.stride(0), q.stride(1), stride_se, stride_sn, bias.stride(0) if bias is not None else 0, y.stride(0), group,
        KIND=kind, GATHER=token_of is not None, HAS_BIAS=bias is not None, DOT_HALF=dot_half,
        FP8_NATIVE=target_arch(a.device) >= 89, BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def moe_combine(y: torch.Tensor, slot_rows: torch.Tensor, weight: torch.Tensor, num_tokens: int, top_k: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum over slots s of weight[r] * y[r], r = slot_rows[t * k + s], in slot order -> [T, H] in
    ``out_dtype``. y [R, H] sorted rows, slot_rows int64 [T * k] (``ExpertGroups.slot_rows``), weight float32
    [R] or [R, 1]; rows r >= R (another rank's experts) add nothing."""
    h = y.shape[1]
    out = torch.empty(num_tokens, h, dtype=out_dtype, device=y.device)
    if num_tokens == 0:
        return out
    block_h = min(1024, next_pow2(h))
    _moe_combine_kernel[(num_tokens, triton.cdiv(h, block_h))](
        y, slot_rows, weight.reshape(-1), out, h, y.shape[0], y.stride(0), out.stride(0), TOP_K=top_k,
        BLOCK_H=block_h)
    return out


__all__ = ["KIND_FLOAT", "ExpertTiles", "StackedRows", "block_m_for", "expert_tiles", "moe_combine",
           "moe_grouped_matmul"]
