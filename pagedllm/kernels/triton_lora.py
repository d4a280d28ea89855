"""The multi-LoRA term for CUDA as Triton kernels, with the C++ kernel's calling convention
(``kernels/csrc/lora_sgmv.cpp``): ``lora_sgmv_(y, x, a_slots, b_slots, slot_ranks, max_rank, row_slots,
band_cols)`` adds ``(x[t] @ A[s]) @ B[s]`` to ``y[t]`` for each row t whose slot s = ``row_slots[t]`` is >= 0.

Two launches, one program per row (and per column block of y): shrink writes h = x @ A[s] for the row's live
bands into a float32 scratch [T, R]; expand adds h @ B[s] into y. A row of slot -1, or of a slot with rank 0 on
this layer, masks every load and store, so the launches need no host-side grouping and read each row's slot on
the device. A [S, K, R] and B [S, R, N] are float32, R = bands * max_rank, band b using columns
[b * max_rank, b * max_rank + slot_ranks[s]) (bf16 slot buffers are read as float32); band b of slot s writes
y's columns ``band_cols[s, b]`` = [lo, hi) only, so the loads of B outside them, and of a band with lo == hi, are
masked off.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.triton_ops import next_pow2, tl, triton

if triton is not None:

    @triton.jit
    def _lora_shrink(x_ptr, x_stride, a_ptr, ranks_ptr, cols_ptr, rows_ptr, h_ptr, K, R, MAX_RANK: tl.constexpr,
                     BANDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(rows_ptr + t)
        live = slot >= 0
        slot = tl.where(live, slot, 0)
        rank = tl.where(live, tl.load(ranks_ptr + slot), 0)
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        a_slot = a_ptr + slot.to(tl.int64) * K * R
        k_end = tl.where(rank > 0, K, 0)  # a row with no term reads nothing
        for band in tl.static_range(BANDS):
            band_cols = cols_ptr + (slot.to(tl.int64) * BANDS + band) * 2
            mask_band = offs_r < tl.where(tl.load(band_cols) < tl.load(band_cols + 1), rank, 0)
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + offs_k
                mask_k = ks < k_end
                xv = tl.load(x_ptr + t.to(tl.int64) * x_stride + ks, mask=mask_k, other=0.0).to(tl.float32)
                av = tl.load(a_slot + ks[:, None] * R + band * MAX_RANK + offs_r[None, :],
                             mask=mask_k[:, None] & mask_band[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(xv[:, None] * av, axis=0)
            tl.store(h_ptr + t.to(tl.int64) * R + band * MAX_RANK + offs_r, acc, mask=offs_r < MAX_RANK)

    @triton.jit
    def _lora_expand(y_ptr, y_stride, h_ptr, b_ptr, ranks_ptr, cols_ptr, rows_ptr, N, R, MAX_RANK: tl.constexpr,
                     BANDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        t = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(rows_ptr + t)
        live = slot >= 0
        slot = tl.where(live, slot, 0)
        rank = tl.where(live, tl.load(ranks_ptr + slot), 0)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        mask_n = offs_n < tl.where(rank > 0, N, 0)
        b_slot = b_ptr + slot.to(tl.int64) * R * N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for band in tl.static_range(BANDS):
            band_cols = cols_ptr + (slot.to(tl.int64) * BANDS + band) * 2
            mask_band = mask_n & (offs_n >= tl.load(band_cols)) & (offs_n < tl.load(band_cols + 1))
            hv = tl.load(h_ptr + t.to(tl.int64) * R + band * MAX_RANK + offs_r, mask=mask_r, other=0.0)
            bv = tl.load(b_slot + (band * MAX_RANK + offs_r)[:, None] * N + offs_n[None, :],
                         mask=mask_r[:, None] & mask_band[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(hv[:, None] * bv, axis=0)
        y_row = y_ptr + t.to(tl.int64) * y_stride + offs_n
        y = tl.load(y_row, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_row, (y + acc).to(y_ptr.dtype.element_ty), mask=mask_n)


def lora_sgmv_(y: torch.Tensor, x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor,
               slot_ranks: torch.Tensor, max_rank: int, row_slots: torch.Tensor, band_cols: torch.Tensor) -> None:
    """In place: y [T, N] += (x [T, K] @ A[s]) @ B[s] for each row of slot s = row_slots[t] >= 0 (int32 [T]);
    A [S, K, R], B [S, R, N] float32 contiguous, slot_ranks [S] int32, band_cols [S, R / max_rank, 2] int32."""
    num_rows, k = x.shape
    r, n = b_slots.shape[1], b_slots.shape[2]
    if (y.shape[0] != num_rows or y.shape[1] != n or a_slots.shape[1] != k or a_slots.shape[2] != r
            or row_slots.shape[0] != num_rows or r % max_rank
            or tuple(band_cols.shape) != (a_slots.shape[0], r // max_rank, 2)):
        raise ValueError("lora_sgmv_: shapes do not agree (y [T, N], x [T, K], A [S, K, R], B [S, R, N], "
                         "band_cols [S, R / max_rank, 2])")
    if num_rows == 0:
        return
    h = torch.empty(num_rows, r, dtype=torch.float32, device=x.device)
    block_r = next_pow2(max_rank)
    bands = r // max_rank
    _lora_shrink[(num_rows,)](x, x.stride(0), a_slots, slot_ranks, band_cols, row_slots, h, k, r,
                              MAX_RANK=max_rank, BANDS=bands, BLOCK_R=block_r, BLOCK_K=64)
    block_n = 128
    _lora_expand[(num_rows, triton.cdiv(n, block_n))](y, y.stride(0), h, b_slots, slot_ranks, band_cols, row_slots,
                                                     n, r, MAX_RANK=max_rank, BANDS=bands, BLOCK_R=block_r,
                                                     BLOCK_N=block_n)
