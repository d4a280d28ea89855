"""Weight-only quantized matmul for CUDA, as one Triton kernel: y = x @ W^T (+ bias) with W stored as int8,
4-bit or fp8 rows plus per-(row, group) scales (and minimums for 4-bit), dequantized tile by tile in
registers. W never exists in float in memory, so a decode step reads 2-4x fewer weight bytes than bf16.

Layouts (``layers/quantization/qrows.py`` builds them), W [N, K]:
  KIND_Q8  int8 [N, K]                                  w = scale * q
  KIND_Q4  uint8 [N, ceil(K / 2)], k even in the low nibble  w = scale * q + min, q in 0..15
  KIND_F8  uint8 [N, K], float8 e4m3fn bit patterns     w = scale * fp8(q)
  scales / mins float32 [N, G], G = ceil(K / group)

Tested through Triton's interpreter on the CPU (tests/quantization/test_triton_quant_matmul.py) and on a GPU
by ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.triton_ops import interpreted, multiprocessors, splits_to_fill, target_arch, triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch ships no triton
    triton = None
    tl = None

KIND_Q8, KIND_Q4, KIND_F8 = 0, 1, 2


def block_k_for(group: int, k: int) -> int:
    """The K tile: a power of two in 16..64 that divides the group (every tile then lies in one group), or
    64 when one group spans the whole row."""
    if group >= k:
        return 64
    for bk in (64, 32, 16):
        if group % bk == 0:
            return bk
    raise ValueError(f"quantization group {group} must be a multiple of 16 (or the whole row)")


if triton is not None:

    @triton.jit
    def dequantized_tile(q_ptr, s_ptr, mn_ptr, offs_n, offs_k, n_ok, k_ok, stride_qn, stride_sn, g,
                         KIND: tl.constexpr, FP8_NATIVE: tl.constexpr):
        """The float32 tile W[offs_n, offs_k] [BLOCK_N, BLOCK_K] of a ``KIND_*`` weight, zero outside (n_ok, k_ok);
        ``g``: the group the whole tile lies in (``block_k_for``)."""
        w_mask = n_ok[:, None] & k_ok[None, :]
        if KIND == 1:
            byte = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] // 2, mask=w_mask, other=0)
            q = ((byte.to(tl.int32) >> ((offs_k[None, :] % 2) * 4)) & 15).to(tl.float32)
        elif KIND == 2:
            raw = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=w_mask, other=0)
            if FP8_NATIVE:  # sm_89+ converts e4m3 in hardware
                q = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:  # e4m3fn by hand (A100 and older): sign, 4 exponent bits (bias 7), 3 mantissa bits
                bits = raw.to(tl.int32)
                exponent = (bits >> 3) & 15
                mantissa = (bits & 7).to(tl.float32) * 0.125
                magnitude = tl.where(exponent == 0, mantissa * 0.015625,
                                     (1.0 + mantissa) * tl.exp2((exponent - 7).to(tl.float32)))
                q = tl.where(bits >= 128, -magnitude, magnitude)
        else:
            q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=w_mask, other=0).to(tl.float32)
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_ok, other=0.0)
        w = q * s[:, None]
        if KIND == 1:
            w += tl.load(mn_ptr + offs_n * stride_sn + g, mask=n_ok, other=0.0)[:, None]
        return tl.where(w_mask, w, 0.0)

    @triton.jit
    def _wo_matmul_kernel(x_ptr, q_ptr, s_ptr, mn_ptr, b_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_qn,
                          stride_sn, stride_ym, group, KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
                          DOT_BF16: tl.constexpr, FP8_NATIVE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        # Split-K: program pid_k takes a run of whole K tiles (so each tile still lies in one group).
        pid_k = tl.program_id(2)
        k_tiles_per_split = (K + BLOCK_K * SPLIT_K - 1) // (BLOCK_K * SPLIT_K)
        k_lo = pid_k * k_tiles_per_split * BLOCK_K
        k_hi = k_lo + k_tiles_per_split * BLOCK_K  # may pass K: the loads mask offs_k >= K
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            w = dequantized_tile(q_ptr, s_ptr, mn_ptr, offs_n, offs_k, n_ok, k_ok, stride_qn, stride_sn, k0 // group,
                                 KIND, FP8_NATIVE)
            if DOT_BF16:  # bf16 / fp16 activations: tensor-core products in their own dtype, float32 sums
                half = x_ptr.dtype.element_ty  # fp16 keeps its 10-bit mantissa (a bf16 cast would drop 3 bits)
                acc += tl.dot(x.to(half), tl.trans(w).to(half))
            else:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        if SPLIT_K > 1:  # a float32 partial [SPLIT_K, M, N]; _sum_splits_kernel adds the bias and stores y
            part = (pid_k * M + offs_m)[:, None] * N + offs_n[None, :]
            tl.store(part_ptr + part, acc, mask=m_ok[:, None] & n_ok[None, :])
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                           BLOCK_N: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        for s in range(SPLIT_K):  # a fixed order: the same sums whatever the batch (deterministic)
            acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)


# Split-K for decode-sized M: a [1, K] x [K, N] product has only N / BLOCK_N programs (9 for N = 576), too few to
# pull the weights at the GPU's bandwidth. Each split takes at least MIN_SPLIT_TILES K tiles; at most MAX_SPLIT_K.
MIN_SPLIT_TILES, MAX_SPLIT_K = 4, 16


def split_k_for(num_programs: int, k_tiles: int, num_sms: int) -> int:
    """Splits of K for a grid of ``num_programs`` (M x N tiles) over ``k_tiles`` K tiles."""
    return splits_to_fill(num_programs, num_sms, min(k_tiles // MIN_SPLIT_TILES, MAX_SPLIT_K))


def weight_only_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                       group: int, out_features: int, kind: int, bias: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (float32 / bf16 / fp16) @ dequantized W^T (+ bias) -> [M, out_features] in x's dtype.

    ``split_k``: K splits, summed by a second kernel in a fixed order (default ``split_k_for`` when M fits one
    tile; a power of two).
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    y = out if out is not None else torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    dot_bf16 = x.dtype in (torch.bfloat16, torch.float16) and not interpreted()
    if dot_bf16:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n, block_k = 64, block_k_for(group, k)
    else:  # float32 dots run on FMA units from registers: 64 x 64 x 64 tiles spill on sm_90, these do not
        block_k_for(group, k)  # the group check
        block_m, block_n, block_k = (16 if m <= 16 else 32), 32, 16
    tiles = triton.cdiv(m, block_m) * triton.cdiv(out_features, block_n)
    if split_k is None:
        split_k = split_k_for(tiles, triton.cdiv(k, block_k), multiprocessors(x.device)) if m <= block_m else 1
    grid = (triton.cdiv(m, block_m), triton.cdiv(out_features, block_n), split_k)
    dummy = scales  # unused pointer arguments still need a tensor
    part = torch.empty(split_k, m, out_features, dtype=torch.float32, device=x.device) if split_k > 1 else dummy
    _wo_matmul_kernel[grid](
        x, qweight, scales, mins if mins is not None else dummy, bias if bias is not None else dummy, y, part,
        m, out_features, k, x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0), group,
        KIND=kind, HAS_BIAS=bias is not None, DOT_BF16=dot_bf16, FP8_NATIVE=target_arch(x.device) >= 89,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k)
    if split_k > 1:
        sum_block = min(1024, triton.next_power_of_2(out_features))
        _sum_splits_kernel[(m, triton.cdiv(out_features, sum_block))](
            part, bias if bias is not None else dummy, y, m, out_features, y.stride(0), HAS_BIAS=bias is not None,
            SPLIT_K=split_k, BLOCK_N=sum_block)
    return y


__all__ = ["interpreted", "KIND_F8", "KIND_Q4", "KIND_Q8", "block_k_for", "triton_available", "weight_only_matmul"]
