"""Triton element-wise ops (CUDA path) against the layers' torch reference, through Triton's interpreter
on the CPU; on a GPU machine run with PAGEDLLM_TEST_DEVICE=cuda TRITON_INTERPRET=0."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.kernels import triton_ops  # noqa: E402
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, apply_rotary  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_ops.triton_available(), reason="triton is a test dependency")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _ref_rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576, 100])
def test_rms_norm_with_and_without_residual(dtype, hidden) -> None:
    torch.manual_seed(hidden)
    x = torch.randn(7, hidden, dtype=dtype)
    res = torch.randn(7, hidden, dtype=dtype)
    w = torch.rand(hidden, dtype=dtype) + 0.5
    summed = x + res
    xd, rd = x.to(DEVICE, copy=True), res.to(DEVICE, copy=True)
    triton_ops.rms_norm_(xd, rd, w.to(DEVICE), 1e-5)
    torch.testing.assert_close(rd.cpu(), summed)
    torch.testing.assert_close(xd.cpu(), _ref_rms(summed, w, 1e-5), **TOL[dtype])
    plain = x.to(DEVICE, copy=True)
    triton_ops.rms_norm_(plain, None, w.to(DEVICE), 1e-5)
    torch.testing.assert_close(plain.cpu(), _ref_rms(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [128, 1536, 1500])
def test_silu_and_mul(dtype, inter) -> None:
    gate_up = torch.randn(5, 2 * inter, dtype=dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = (F.silu(gate) * up).to(dtype)
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up.to(DEVICE)).cpu(), expected, **TOL[dtype])


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (3, 1, 12)])
def test_rotary_in_place_inside_qkv(num_heads, num_kv_heads, head_dim) -> None:
    emb = RotaryEmbedding(head_dim, 256, 10000.0, {}, torch.float32)
    t = 6
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim)
    positions = torch.tensor([0, 5, 17, 3, 200, 64])
    cos, sin = emb.lookup(positions)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    expected = qkv.clone()
    expected[:, :q_size] = apply_rotary(qkv[:, :q_size], cos, sin, num_heads)
    expected[:, q_size:q_size + kv_size] = apply_rotary(qkv[:, q_size:q_size + kv_size], cos, sin, num_kv_heads)
    got = qkv.to(DEVICE, copy=True)
    triton_ops.rotary_(got, positions.to(DEVICE), emb.cos_sin_cache.to(DEVICE), num_heads + num_kv_heads, head_dim)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)  # v untouched, q/k rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 16), (6, 6, 8)])
def test_rotary_and_kv_write_in_one_kernel(dtype, num_heads, num_kv_heads, head_dim) -> None:
    """The fused kernel leaves qkv as ``rotary_`` does and the cache as writing the rotated k and v by slot
    does, bit for bit; slot -1 writes nothing, other slots stay untouched."""
    torch.manual_seed(num_heads * head_dim)
    emb = RotaryEmbedding(head_dim, 256, 10000.0, {}, torch.float32)
    t, block_size, num_blocks = 5, 4, 6
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    positions = torch.tensor([0, 9, 17, 3, 200])
    slots = torch.tensor([5, 22, -1, 0, 13])
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    table = emb.cos_sin_cache.to(DEVICE)
    expected_qkv = qkv.to(DEVICE, copy=True)
    triton_ops.rotary_(expected_qkv, positions.to(DEVICE), table, num_heads + num_kv_heads, head_dim)
    expected_qkv = expected_qkv.cpu()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    expected_cache = cache.clone()
    flat = expected_cache.view(2, -1, num_kv_heads, head_dim)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            flat[0, slot] = expected_qkv[row, q_size:q_size + kv_size].view(num_kv_heads, head_dim)
            flat[1, slot] = expected_qkv[row, q_size + kv_size:].view(num_kv_heads, head_dim)
    got_qkv, got_cache = qkv.to(DEVICE, copy=True), cache.to(DEVICE, copy=True)
    triton_ops.rotary_and_write_kv_(got_qkv, positions.to(DEVICE), table, num_heads, num_kv_heads, head_dim,
                                    got_cache, slots.to(DEVICE))
    torch.testing.assert_close(got_qkv.cpu(), expected_qkv, atol=0, rtol=0)
    torch.testing.assert_close(got_cache.cpu(), expected_cache, atol=0, rtol=0)


def test_dispatch_by_device() -> None:
    from pagedllm.platforms import platform_of

    def elementwise_kernels_for(t: torch.Tensor):
        return platform_of(t).elementwise_kernels(t.dtype)

    # CUDA tensors get the Triton ops; CPU tensors never do (the interpreter is for tests only).
    got = elementwise_kernels_for(torch.zeros(1, device=DEVICE))
    assert (got is triton_ops.TRITON_OPS) == (DEVICE == "cuda")
    assert elementwise_kernels_for(torch.zeros(1, dtype=torch.bfloat16)) is not triton_ops.TRITON_OPS
