"""The C++ CPU matmul and element-wise kernels against plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization.unquantized import pack_weight
from pagedllm.model_executor.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from pagedllm.platforms.cpu_probes import onednn_bf16_available


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    assert k is not None, "the C++ CPU kernels must build on the test machine"
    return k


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 200])  # row tails of the 6-row register tile
@pytest.mark.parametrize("k_dim,n", [(576, 960), (37, 13), (8, 1), (600, 40), (1, 17)])  # column tails, K chunks
def test_packed_gemm_matches_linear(kernels, m: int, k_dim: int, n: int) -> None:
    torch.manual_seed(m * 1000 + n)
    x, w, b = torch.randn(m, k_dim), torch.randn(n, k_dim), torch.randn(n)
    packed = pack_weight(w)
    assert packed.shape == (-(-n // 16), k_dim, 16)
    torch.testing.assert_close(kernels.packed_gemm(x, packed, n), F.linear(x, w), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernels.packed_gemm(x, packed, n, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    xs = torch.randn(m, 2 * k_dim)[:, :k_dim]  # strided input rows
    torch.testing.assert_close(kernels.packed_gemm(xs, packed, n), F.linear(xs, w), atol=1e-4, rtol=1e-4)


def test_packed_gemm_large_k_and_rows_span_several_blocks(kernels) -> None:
    # 1536 columns -> several K chunks; 301 rows -> several row blocks at that K.
    torch.manual_seed(0)
    x, w, b = torch.randn(301, 1536), torch.randn(48, 1536), torch.randn(48)
    torch.testing.assert_close(kernels.packed_gemm(x, pack_weight(w), 48, b), F.linear(x, w, b),
                               atol=2e-4, rtol=1e-4)


def test_packed_gemm_writes_into_out(kernels) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(7, 40), torch.randn(33, 40)
    buffer = torch.full((9, 50), 7.0)
    out = buffer[:7, :33]  # rows of a wider buffer
    got = kernels.packed_gemm(x, pack_weight(w), 33, None, out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert bool((buffer[:7, 33:] == 7.0).all()) and bool((buffer[7:] == 7.0).all())  # nothing else touched
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.packed_gemm(x, pack_weight(w), 33, None, torch.empty(6, 33))


def test_packed_gemm_rejects_bad_shapes(kernels) -> None:
    packed = pack_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="columns"):
        kernels.packed_gemm(torch.randn(2, 9), packed, 20)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.packed_gemm(torch.randn(2, 8), packed, 40)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.packed_gemm(torch.randn(2, 8, dtype=torch.float64), packed, 20)
    assert kernels.packed_gemm(torch.randn(0, 8), packed, 20).shape == (0, 20)


def test_linear_packs_its_weight_and_keeps_its_output(kernels) -> None:
    torch.manual_seed(0)
    layer = Linear(64, 40, bias=True)
    x = torch.randn(3, 5, 64)  # leading dims are kept
    with torch.no_grad():
        expected = layer(x)
        layer.process_weights_after_loading()
        assert layer.weight is None and layer.packed.panels is not None
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_linear_stays_plain_where_the_kernels_do_not_apply() -> None:
    layer = Linear(16, 8, dtype=torch.float16)
    layer.process_weights_after_loading()
    assert layer.weight is not None and layer.packed.in_layer_parameters  # the plain parameter, F.linear


@pytest.mark.parametrize("m", [1, 7, 300])
def test_bf16_linear_packed_for_onednn_with_fused_activations(m: int) -> None:
    """bf16 weights on a CPU with native bf16: prepacked for oneDNN, bias and GELU / ReLU fused."""
    if not onednn_bf16_available():
        pytest.skip("this CPU has no native bf16 (oneDNN's packed bf16 linear is not used here)")
    torch.manual_seed(m)
    layer = Linear(96, 40, bias=True, dtype=torch.bfloat16)
    w, b = layer.weight.detach().float().clone(), layer.bias.detach().float().clone()
    layer.process_weights_after_loading()
    assert layer.weight is None and layer.packed.onednn is not None
    assert layer.weight_nbytes() == 96 * 40 * 2 + 40 * 2
    x = torch.randn(m, 96).bfloat16()
    ref = F.linear(x.float(), w, b)
    tol = dict(atol=0.05 * ref.abs().max().item(), rtol=0.02)
    torch.testing.assert_close(layer(x).float(), ref, **tol)
    torch.testing.assert_close(layer(x.view(m, 1, 96)).float(), ref.view(m, 1, 40), **tol)  # leading dims kept
    for act, fn in [("gelu", F.gelu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")), ("relu", F.relu)]:
        torch.testing.assert_close(layer.forward_activation(x, act).float(), fn(ref), **tol)
    assert layer.forward_activation(x, "silu") is None  # not fusable: the caller applies it
    plain = Linear(96, 40, bias=True, dtype=torch.float32)
    assert plain.forward_activation(torch.randn(m, 96), "gelu") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("want_bf16", [False, True])
def test_add_layer_norm(kernels, dtype: torch.dtype, want_bf16: bool) -> None:
    torch.manual_seed(0)
    x, res = torch.randn(37, 384).to(dtype), torch.randn(37, 384)
    w, b = torch.randn(384), torch.randn(384)
    out, low = kernels.add_layer_norm(x, res, w, b, 1e-12, want_bf16)
    ref = F.layer_norm(x.float() + res, (384,), w, b, 1e-12)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    if want_bf16:
        assert low.dtype == torch.bfloat16
        torch.testing.assert_close(low, out.bfloat16(), atol=0, rtol=0)  # round to nearest even, as torch
    else:
        assert low.data_ptr() == out.data_ptr()
    with pytest.raises(RuntimeError, match="residual must be float32"):
        kernels.add_layer_norm(x, res.bfloat16(), w, b, 1e-12, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_in_place(kernels, dtype: torch.dtype, tanh: bool) -> None:
    torch.manual_seed(1)
    x = (torch.randn(9, 1536) * 4).to(dtype)
    ref = F.gelu(x.float(), approximate="tanh" if tanh else "none")
    y = x.clone()
    kernels.gelu_(y, tanh)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_out_of_place_leaves_x_and_fills_out(kernels, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 2 * 576, dtype=dtype)[:, :576]  # strided rows, as a view of a wider output
    w = torch.randn(576, dtype=dtype)
    before = x.clone()
    in_place = x.clone()
    kernels.rms_norm_(in_place, None, w, 1e-5)
    got = kernels.rms_norm(x, w, 1e-5)
    assert torch.equal(got, in_place) and torch.equal(x, before)
    out = torch.empty(7, 576, dtype=dtype)
    kernels.rms_norm(x, w, 1e-5, out)
    assert torch.equal(out, in_place)
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.rms_norm(x, w, 1e-5, torch.empty(6, 576, dtype=dtype))


def test_silu_and_mul_into_out(kernels) -> None:
    gate_up = torch.randn(3, 40)
    out = torch.full((3, 20), float("nan"))
    kernels.silu_and_mul(gate_up, out)
    assert torch.equal(out, kernels.silu_and_mul(gate_up))
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.silu_and_mul(gate_up, torch.empty(3, 21))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_equals_f_embedding_and_checks_ids(kernels, dtype: torch.dtype) -> None:
    table = torch.randn(50, 24).to(dtype)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(kernels.embedding_rows(table, ids), F.embedding(ids, table))
    out = torch.empty(4, 24, dtype=dtype)
    kernels.embedding_rows(table, ids, out)
    assert torch.equal(out, F.embedding(ids, table))
    for bad in (50, -1):
        with pytest.raises(RuntimeError, match="out of range"):
            kernels.embedding_rows(table, torch.tensor([1, bad]))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_far_from_zero(kernels, dtype: torch.dtype) -> None:
    # 32 gates (two 16-lane vectors and a tail) from -200 to 200: e^-x overflows float for x < -88.7, where the
    # SiLU is -0 to float precision, and must not become NaN or anything far from it.
    gate = torch.linspace(-200, 200, 35)
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None].to(dtype)
    got = kernels.silu_and_mul(gate_up).float()
    assert not got.isnan().any()
    torch.testing.assert_close(got, (F.silu(gate) * 1.5)[None].to(dtype).float(), atol=1e-5, rtol=1e-2)


def _bf16_matches(got: torch.Tensor, ref: torch.Tensor, share: float = 0.99) -> None:
    """bf16 results: within one bf16 step everywhere and bit-equal almost everywhere (a missed rounding point
    of the reference would leave about a third of the elements one step off)."""
    assert got.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-6, rtol=2 ** -6)  # a step is 2^-8..2^-7 of it
    assert (got == ref).float().mean().item() >= share


@pytest.mark.parametrize("t", [1, 5, 70])
def test_rms_norm_bf16_rounds_where_the_torch_path_does(kernels, t: int) -> None:
    torch.manual_seed(t)
    x, res = torch.randn(t, 576, dtype=torch.bfloat16), torch.randn(t, 576, dtype=torch.bfloat16)
    w = (torch.randn(576) * 0.5 + 1).to(torch.bfloat16)

    def reference(v: torch.Tensor) -> torch.Tensor:  # layers/layernorm.py's torch path
        v32 = v.float()
        return w * (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)

    out = x.clone()
    kernels.rms_norm_(out, None, w, 1e-5)
    _bf16_matches(out, reference(x))
    xi, ri = x.clone(), res.clone()
    kernels.rms_norm_(xi, ri, w, 1e-5)
    assert torch.equal(ri, x + res)
    _bf16_matches(xi, reference(x + res))
    with pytest.raises(RuntimeError, match="weight must have the dtype of x"):
        kernels.rms_norm_(x.clone(), None, w.float(), 1e-5)


def test_rotary_bf16_equals_the_torch_path(kernels) -> None:
    torch.manual_seed(1)
    heads, kv_heads, d, t = 9, 3, 64, 11
    emb = RotaryEmbedding(d, 256, 10000.0, {}, torch.bfloat16)
    positions = torch.randint(0, 256, (t,))
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, dtype=torch.bfloat16)
    cos, sin = emb.lookup(positions)
    q_ref = apply_rotary(qkv[:, :heads * d], cos, sin, heads)
    k_ref = apply_rotary(qkv[:, heads * d:(heads + kv_heads) * d], cos, sin, kv_heads)
    kernels.rotary_(qkv, positions, emb.cos_sin_cache, heads + kv_heads, d)
    assert torch.equal(qkv[:, :heads * d], q_ref)
    assert torch.equal(qkv[:, heads * d:(heads + kv_heads) * d], k_ref)
    with pytest.raises(RuntimeError, match="cos_sin must have the dtype of x"):
        kernels.rotary_(qkv, positions, emb.cos_sin_cache.float(), heads, d)


@pytest.mark.parametrize("t,i", [(1, 1536), (70, 20)])
def test_silu_and_mul_bf16_rounds_where_the_torch_path_does(kernels, t: int, i: int) -> None:
    torch.manual_seed(t)
    gate_up = (torch.randn(t, 2 * i) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    _bf16_matches(kernels.silu_and_mul(gate_up), F.silu(gate) * up)
    out = torch.full((t, i), float("nan"), dtype=torch.bfloat16)
    kernels.silu_and_mul(gate_up, out)
    assert torch.equal(out, kernels.silu_and_mul(gate_up))
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.silu_and_mul(gate_up, torch.empty(t, i))  # float32 out for bf16 input


def test_bf16_layers_take_the_fused_kernels_except_gemma_offset() -> None:
    """RMSNorm (plain w), rotary and SiLU-and-mul in bf16 run the fused passes; Gemma's (1 + w) keeps the
    reference's float32 scale (torch path), since (1 + w) rounded to bf16 would change its result."""
    from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from pagedllm.platforms import platform_of

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert platform_of(x).elementwise_kernels(torch.bfloat16) is not None
    assert platform_of(x).rotary_kernels(torch.bfloat16, torch.bfloat16) is not None
    assert platform_of(x).rotary_kernels(torch.bfloat16, torch.float32) is None
    assert platform_of(x).activation_kernels(torch.bfloat16) is not None
    assert platform_of(x).activation_kernels(torch.float32) is not None
    assert platform_of(x).activation_kernels(torch.float16) is None
    gemma = GemmaRMSNorm(64, 1e-6, torch.bfloat16)
    with torch.no_grad():
        gemma.weight.normal_()
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (gemma.weight.float() + 1)).to(
        torch.bfloat16)
    assert torch.equal(gemma(x), expected)
    plain = RMSNorm(64, 1e-6, torch.bfloat16)
    residual = torch.randn(4, 64, dtype=torch.bfloat16)
    summed = x + residual
    out, res = plain(x.clone(), residual.clone())
    assert torch.equal(res, summed)
    _bf16_matches(out, (summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
        torch.bfloat16), share=0.95)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,c", [(1, 512), (7, 384), (1500, 512), (3, 45)])  # lane tails: 45 = 32 + 13
def test_layer_norm_with_and_without_residual_matches_torch(kernels, dtype: torch.dtype, t: int, c: int) -> None:
    """residual = x + residual rounded as torch's add; x = LayerNorm(residual), one rounding as torch's (bf16: equal
    but for one ulp where float32 statistics differ in their last bit)."""
    torch.manual_seed(t + c)
    x, r = (3 * torch.randn(t, c)).to(dtype), (10 * torch.randn(t, c)).to(dtype)
    w, b = (torch.randn(c) * 0.5 + 1).to(dtype), (torch.randn(c) * 0.1).to(dtype)
    ref_r = x + r
    ref = F.layer_norm(ref_r, (c,), w, b, 1e-5)
    xi, ri = x.clone(), r.clone()
    kernels.layer_norm_(xi, ri, w, b, 1e-5)
    assert torch.equal(ri, ref_r)
    plain = kernels.layer_norm(ref_r, w, b, 1e-5)
    assert torch.equal(plain, xi)
    if dtype == torch.float32:
        torch.testing.assert_close(xi, ref, atol=1e-5, rtol=1e-5)
    else:
        ulp = (xi.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)
        assert float(ulp.max()) <= 2 ** -7 and float((xi != ref).float().mean()) < 1e-3
    out = torch.empty(t, c, dtype=dtype)
    assert kernels.layer_norm(ref_r, w, b, 1e-5, out) is not None and torch.equal(out, plain)
    with pytest.raises(RuntimeError, match="weight and bias"):
        kernels.layer_norm(ref_r, w[:-1], b, 1e-5)
