"""The C++ CPU matmul and element-wise kernels against plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model_executor.layers.linear import PrepackedWeight
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, apply_rotary


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    assert k is not None, "the C++ CPU kernels must build on the test machine"
    return k


@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize("k_dim,n", [(576, 960), (37, 13), (8, 1)])  # odd sizes take the tail loops
def test_small_gemm(kernels, m: int, k_dim: int, n: int) -> None:
    torch.manual_seed(m)
    x, w, b = torch.randn(m, k_dim), torch.randn(n, k_dim), torch.randn(n)
    torch.testing.assert_close(kernels.small_gemm(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernels.small_gemm(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    xs = torch.randn(m, 2 * k_dim)[:, :k_dim]  # strided input rows
    torch.testing.assert_close(kernels.small_gemm(xs, w), F.linear(xs, w), atol=1e-4, rtol=1e-4)


def test_small_gemm_rejects_bad_shapes(kernels) -> None:
    with pytest.raises(RuntimeError, match="1..8 rows"):
        kernels.small_gemm(torch.randn(9, 4), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.small_gemm(torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("t", [1, 5, 70])
def test_rms_norm_with_and_without_residual(kernels, t: int) -> None:
    torch.manual_seed(t)
    x, res, w = torch.randn(t, 576), torch.randn(t, 576), torch.randn(576)
    out = x.clone()
    kernels.rms_norm_(out, None, w, 1e-5)
    torch.testing.assert_close(out, _rms(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    xi, ri = x.clone(), res.clone()
    kernels.rms_norm_(xi, ri, w, 1e-5)
    torch.testing.assert_close(ri, x + res)
    torch.testing.assert_close(xi, _rms(x + res, w, 1e-5), atol=1e-5, rtol=1e-5)


def test_rotary_matches_torch_path_in_a_strided_qkv(kernels) -> None:
    torch.manual_seed(0)
    heads, kv_heads, d, t = 9, 3, 64, 11
    emb = RotaryEmbedding(d, 256, 10000.0, {}, torch.float32)
    positions = torch.randint(0, 256, (t,))
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    cos, sin = emb.lookup(positions)
    q_ref = apply_rotary(qkv[:, :heads * d], cos, sin, heads)
    k_ref = apply_rotary(qkv[:, heads * d:(heads + kv_heads) * d], cos, sin, kv_heads)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    kernels.rotary_(qkv, positions, emb.cos_sin_cache, heads + kv_heads, d)
    torch.testing.assert_close(qkv[:, :heads * d], q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, heads * d:(heads + kv_heads) * d], k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # v is not rotated
    with pytest.raises(RuntimeError, match="position out of range"):
        kernels.rotary_(qkv, torch.full((t,), 256), emb.cos_sin_cache, heads, d)


@pytest.mark.parametrize("t,i", [(1, 1536), (33, 20)])
def test_silu_and_mul(kernels, t: int, i: int) -> None:
    torch.manual_seed(t)
    gate_up = torch.randn(t, 2 * i) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [3, 20])  # small-batch kernel / oneDNN packed weight
def test_prepacked_weight_matches_linear(m: int) -> None:
    torch.manual_seed(m)
    w, x = torch.randn(300, 64), torch.randn(m, 64)
    head = PrepackedWeight(w)
    torch.testing.assert_close(head(x), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_prepacked_weight_falls_back_when_onednn_fails(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no such op in this build")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
    w, x = torch.randn(300, 64), torch.randn(20, 64)
    head = PrepackedWeight(w)
    torch.testing.assert_close(head(x), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert not head._usable
