"""Fused element-wise ops of a decoder layer for CUDA, as Triton kernels: RMSNorm (+ the residual add
before it), SiLU-and-mul, and rotary embedding in place inside the fused qkv output.

They mirror the CPU kernels' calling conventions (``kernels/csrc/fused_ops.cpp``), so a layer binds the family
its tensors' platform names (``model_executor/layers/kernel_binding.py``) and calls the same names on either
device. Eager PyTorch spends 4-8 kernel launches on each of these ops; here each is one. Statistics are
taken in float32 whatever the dtype.
"""

from __future__ import annotations

import functools

import torch

from pagedllm import envs

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch ships no triton
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None


# Under TRITON_INTERPRET=1 (the tests on the CPU) Triton's interpreter multiplies bf16 operands of tl.dot and
# computes bf16 arithmetic as raw bits (triton 3.9): kernels that dot bf16 operands upcast to fp32 there.
# Read once: Triton fixes the mode when its kernels are defined, and launches ask on every call.
@functools.cache
def interpreted() -> bool:
    return envs.TRITON_INTERPRET


def target_arch(device: torch.device) -> int:
    """The GPU architecture launches on ``device`` tune for, as major * 10 + minor (90: H100/H200, 80: A100).
    Tensors off a GPU (the interpreter, the ahead-of-time compile check) get ``PAGEDLLM_TRITON_ARCH`` (90)."""
    if device.type == "cuda":
        return _cuda_properties(device.index)[0]
    return envs.PAGEDLLM_TRITON_ARCH


@functools.cache
def _cuda_properties(index: int | None) -> tuple[int, int]:
    """(architecture, multiprocessors) of a CUDA device, read once: launches ask in every layer of every step."""
    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    return props.major * 10 + props.minor, props.multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H200); 64 off a GPU, where only the interpreter and
    the compile check launch (an arbitrary GPU-sized count, so those exercise the same launch choices)."""
    if device.type == "cuda":
        return _cuda_properties(device.index)[1]
    return 64


# A kernel whose grid leaves the GPU idle (a batch-1 decode) splits its work until about this many programs per
# SM run; the split counts are powers of two, so they stay few compiled variants.
PROGRAMS_PER_SM = 2


def splits_to_fill(num_programs: int, num_sms: int, most: int) -> int:
    """How many ways to split each of ``num_programs`` programs so ``num_sms`` multiprocessors fill: a power of
    two, at most ``most`` (1: no split)."""
    want = min(-(-PROGRAMS_PER_SM * num_sms // max(1, num_programs)), most)
    return 1 << max(0, want.bit_length() - 1)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, stride_x, stride_r, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        # Arithmetic in float32 throughout (also: Triton's interpreter computes bf16 arithmetic on raw bits).
        x32 = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x32 += tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            # The residual stream keeps the model dtype: round the sum before taking statistics of it.
            x = x32.to(x_ptr.dtype.element_ty)
            tl.store(res_ptr + row * stride_r + cols, x, mask=ok)
            x32 = x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(x_ptr + row * stride_x + cols, (w * normed).to(x_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotary_kernel(qkv_ptr, pos_ptr, cache_ptr, kv_ptr, slot_ptr, stride_qkv, stride_cache, num_heads,
                       num_q_heads, num_kv_heads, kv_half,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_KV: tl.constexpr,
                       WRITE_KV: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        i = tl.arange(0, BLOCK_HALF)
        i_ok = i < HALF
        cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i_ok, other=0.0).to(tl.float32)
        sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
        heads = tl.arange(0, BLOCK_H)
        ok = (heads < num_heads)[:, None] & i_ok[None, :]
        base = qkv_ptr + tok * stride_qkv + heads[:, None] * (2 * HALF) + i[None, :]
        x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
        y1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(qkv_ptr.dtype.element_ty)
        y2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(qkv_ptr.dtype.element_ty)
        tl.store(base, y1, mask=ok)
        tl.store(base + HALF, y2, mask=ok)
        if WRITE_KV:  # this token's rotated K and its V into the paged cache, at its slot (-1: none)
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if slot >= 0:
                row = kv_ptr + slot * (num_kv_heads * 2 * HALF)  # [Hkv, D] of the slot in the K half
                k_ok = ok & (heads >= num_q_heads)[:, None]
                k_dst = row + (heads - num_q_heads)[:, None] * (2 * HALF) + i[None, :]
                tl.store(k_dst, y1.to(kv_ptr.dtype.element_ty), mask=k_ok)
                tl.store(k_dst + HALF, y2.to(kv_ptr.dtype.element_ty), mask=k_ok)
                v_heads = tl.arange(0, BLOCK_KV)
                v_ok = (v_heads < num_kv_heads)[:, None] & i_ok[None, :]
                v_src = qkv_ptr + tok * stride_qkv + (num_heads + v_heads)[:, None] * (2 * HALF) + i[None, :]
                v_dst = row + kv_half + v_heads[:, None] * (2 * HALF) + i[None, :]
                tl.store(v_dst, tl.load(v_src, mask=v_ok, other=0.0).to(kv_ptr.dtype.element_ty), mask=v_ok)
                tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=v_ok, other=0.0).to(kv_ptr.dtype.element_ty),
                         mask=v_ok)


def rms_norm_(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> None:
    """In place. x, residual: [T, hidden] (last dim contiguous). With a residual: residual <- x + residual,
    x <- norm(residual) * weight; without: x <- norm(x) * weight."""
    t, n = x.shape
    res = residual if residual is not None else x
    _rms_norm_kernel[(t,)](x, res, weight, x.stride(0), res.stride(0), n, eps,
                           HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(n))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] laid out [gate | up] -> silu(gate) * up, [T, I]."""
    t, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(n))
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out


def rotary_(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int,
            head_dim: int) -> None:
    """In place: rotate (rotate-half pairing) the first ``num_heads`` heads of each row of qkv [T, >= H*D]
    at ``positions`` [T]; cos_sin_cache: [max_position, D] laid out [cos(D/2) | sin(D/2)]."""
    half = head_dim // 2
    _rotary_kernel[(qkv.shape[0],)](qkv, positions, cos_sin_cache, qkv, positions, qkv.stride(0),
                                    cos_sin_cache.stride(0), num_heads, num_heads, 0, 0, HALF=half,
                                    BLOCK_H=next_pow2(num_heads), BLOCK_HALF=next_pow2(half), BLOCK_KV=1,
                                    WRITE_KV=False)


def rotary_and_write_kv_(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int,
                         num_kv_heads: int, head_dim: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotary and the KV-cache write of one attention layer in one launch (instead of three).

    qkv: [T, (H + 2*Hkv) * D] laid out [q | k | v]; q and k are rotated in place (as ``rotary_``), then each
    token's rotated k and its v go to ``kv_cache`` [2, num_blocks, block_size, Hkv, D] (contiguous) at
    ``slot_mapping`` [T] (slot -1: not written).
    """
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    half = head_dim // 2
    rotated = num_heads + num_kv_heads
    _rotary_kernel[(qkv.shape[0],)](qkv, positions, cos_sin_cache, kv_cache, slot_mapping, qkv.stride(0),
                                    cos_sin_cache.stride(0), rotated, num_heads, num_kv_heads,
                                    kv_cache[0].numel(), HALF=half, BLOCK_H=next_pow2(rotated),
                                    BLOCK_HALF=next_pow2(half), BLOCK_KV=next_pow2(num_kv_heads), WRITE_KV=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, C] -> rms_norm(x) * weight, [T, C] (x left as it is)."""
    out = x.clone()
    rms_norm_(out, None, weight, eps)
    return out


class _TritonOps:
    """The element-wise ops under the CPU kernels' names, plus rotary fused with the KV-cache write."""

    rms_norm_ = staticmethod(rms_norm_)
    rms_norm = staticmethod(rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
    rotary_ = staticmethod(rotary_)
    rotary_and_write_kv_ = staticmethod(rotary_and_write_kv_)


TRITON_OPS = _TritonOps()
