"""The quantized matmul kernels (q8 / q4 panels) against dequantize-then-matmul, on every ISA this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import ISA_CODES, load_cpu_kernels
from pagedllm.model_executor.layers.quantization.qpanels import QPanels, quantize_f8, quantize_q4, quantize_q8

ROWS = [1, 2, 3, 5, 6, 7, 8, 9, 13, 17, 40]  # every tile height and tail of the 6- and 8-row tiles


@pytest.fixture(scope="module")
def kernels():
    k = load_cpu_kernels()
    assert k is not None, "the C++ CPU kernels must build on the test machine"
    return k


def _isas() -> list[str]:
    k = load_cpu_kernels()
    codes = set(k.supported_isas()) if k is not None else set()
    return [name for name, code in ISA_CODES.items() if code in codes and name != "auto"]


def _check(panels: QPanels, isa: str, n: int, k: int, with_bias: bool) -> None:
    w = panels.dequantize().double()
    bias = torch.randn(n) if with_bias else None
    for m in ROWS:
        x = torch.randn(m, k)
        y = panels.matmul(x, bias, isa=ISA_CODES[isa])
        ref = F.linear(x.double(), w, None if bias is None else bias.double()).float()
        assert y.shape == (m, n)
        torch.testing.assert_close(y, ref, atol=2e-4 * k ** 0.5, rtol=1e-4, msg=f"rows {m}")


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize(("n", "k", "group"), [(37, 64, None), (16, 96, 32), (100, 128, 64), (5, 256, 128)])
def test_q8_matches_dequantized_reference(kernels, isa: str, n: int, k: int, group: int | None) -> None:
    torch.manual_seed(n + k)
    q, s = quantize_q8(torch.randn(n, k), group or k)
    _check(QPanels.pack_q8(q, s), isa, n, k, with_bias=n % 2 == 1)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize(("n", "k", "group"), [(37, 64, 32), (16, 96, 32), (100, 128, 64), (3, 256, 128)])
def test_q4_matches_dequantized_reference(kernels, isa: str, n: int, k: int, group: int) -> None:
    torch.manual_seed(n * k)
    q, s, mins = quantize_q4(torch.randn(n, k), group)
    _check(QPanels.pack_q4(q, s, mins, layout="pairs"), isa, n, k, with_bias=n % 2 == 1)


def _int8_activation_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, mins: torch.Tensor,
                               group: int) -> torch.Tensor:
    """What q4_dot_gemm computes, in float64: x per (row, group) as dx * x1 + dx / 254 * x2 with x1, x2 int8
    (dx = max|x| / 127, x2 the rounding residual of x1), the weight levels' dot products exact, the minimum
    times the exact group sum of x."""
    m, k = x.shape
    xf = x.float().view(m, k // group, group)
    amax = xf.abs().amax(-1)  # [M, G]
    # one float32 division, as the kernel (127 / amax would be reciprocal(amax) * 127: two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    x1 = torch.round(xf * inv.unsqueeze(-1))
    # the residual of the unrounded product, rounded once to float32 (the kernel's fused multiply-add)
    res = (xf.double() * inv.double().unsqueeze(-1) - x1.double()).float()
    x2 = torch.round(res * 254).clamp(-127, 127)
    dx = (amax / 127).double()
    qg = q.double().view(-1, k // group, group)
    d1 = torch.einsum("mgk,ngk->mng", x1.double(), qg)  # [M, N, G]
    d2 = torch.einsum("mgk,ngk->mng", x2.double(), qg)
    y = ((d1 + d2 / 254) * dx.unsqueeze(1) * s.double().unsqueeze(0)).sum(-1)
    return (y + xf.double().sum(-1) @ mins.double().t()).float()


def _fp16_params(q: torch.Tensor, s: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Scales and mins as the dot8 layout stores them (float16), for exact references."""
    return q, s.half().float(), mins.half().float()


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize(("n", "k", "group"), [(37, 64, 32), (16, 96, 32), (100, 128, 64), (3, 256, 128),
                                               (17, 48, 8)])
def test_q4_dot8_matches_int8_activation_reference(kernels, isa: str, n: int, k: int, group: int) -> None:
    """The dot8 layout (default for 4-bit): every row-tile tail (1..4 rows, then blocks), odd N, bias."""
    torch.manual_seed(n * k + 1)
    q, s, mins = _fp16_params(*quantize_q4(torch.randn(n, k), group))
    panels = QPanels.pack_q4(q, s, mins)
    assert panels.layout == "dot8"
    bias = torch.randn(n) if n % 2 else None
    for m in ROWS:
        x = torch.randn(m, k) * 2
        ref = _int8_activation_reference(x, q, s, mins, group) + (0 if bias is None else bias)
        y = panels.matmul(x, bias, isa=ISA_CODES[isa])
        torch.testing.assert_close(y, ref, atol=1e-4 * k ** 0.5, rtol=1e-5, msg=f"rows {m}")
        # and, with x's two int8 terms, close to the float product
        torch.testing.assert_close(y, F.linear(x, panels.dequantize(), bias), atol=1e-3 * k ** 0.5, rtol=1e-3)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("group", [32, 64])
def test_q4_dot8_integer_sums_at_their_extremes_do_not_wrap(kernels, isa: str, group: int) -> None:
    """Every 4-bit level 15 against activations whose int8 terms are both near +-127 (x1 = 126 or 127, the
    residual x2 about 127): the largest byte-dot sums a group can make. The AVX2 tiles add a 32-k group's
    products in int16 lanes before widening them; nothing may wrap."""
    n, k = 32, 128
    q = torch.full((n, k), 15, dtype=torch.uint8)
    _, s, mins = _fp16_params(q, torch.full((n, k // group), 0.01), torch.full((n, k // group), -0.05))
    panels = QPanels.pack_q4(q, s, mins)
    assert panels.layout == "dot8"
    row = torch.full((k,), 126.5 / 127)
    row[::group] = 1.0  # max|x| of each group: x1 = 127 there, 126 with a residual of ~127 elsewhere
    for sign in (1.0, -1.0):
        x = (3.0 * sign * row).expand(4, k).contiguous()
        y = panels.matmul(x, None, isa=ISA_CODES[isa])
        torch.testing.assert_close(y, _int8_activation_reference(x, q, s, mins, group), atol=1e-4 * k ** 0.5,
                                   rtol=1e-5)


def test_q4_layouts_hold_the_same_weights() -> None:
    torch.manual_seed(3)
    q, s, mins = _fp16_params(*quantize_q4(torch.randn(21, 64), 32))
    dot8, pairs = QPanels.pack_q4(q, s, mins), QPanels.pack_q4(q, s, mins, layout="pairs")
    assert dot8.qweight.shape == (2, 8, 64) and pairs.qweight.shape == (2, 32, 16)
    assert dot8.scales.dtype == dot8.mins.dtype == torch.float16  # a fifth of the bytes, not a third
    assert dot8.nbytes() == 2 * 16 * (64 // 2 + 2 * 2 * 2) and pairs.nbytes() == 2 * 16 * (64 // 2 + 2 * 2 * 4)
    torch.testing.assert_close(dot8.dequantize(), pairs.dequantize(), atol=0, rtol=0)
    assert QPanels.pack_q4(*quantize_q4(torch.randn(4, 36), 12)).layout == "pairs"  # group not a multiple of 8
    with pytest.raises(ValueError, match="multiple of 8"):
        QPanels.pack_q4(*quantize_q4(torch.randn(4, 36), 12), layout="dot8")


def test_q4_dot8_rows_are_independent_of_the_batch(kernels) -> None:
    """Each row's activations are quantized on their own: a row's result is the same alone and in a batch."""
    torch.manual_seed(4)
    panels = QPanels.pack_q4(*quantize_q4(torch.randn(50, 128), 32))
    x = torch.randn(37, 128)
    batched = panels.matmul(x)
    for i in (0, 5, 36):
        assert torch.equal(panels.matmul(x[i:i + 1]), batched[i:i + 1])


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize(("n", "k", "group"), [(37, 64, None), (16, 96, 32), (100, 128, 64), (5, 256, 128)])
def test_f8_matches_dequantized_reference(kernels, isa: str, n: int, k: int, group: int | None) -> None:
    torch.manual_seed(n + 3 * k)
    q, s = quantize_f8(torch.randn(n, k), group or k)
    _check(QPanels.pack_f8(q, s), isa, n, k, with_bias=n % 2 == 1)


@pytest.mark.parametrize("isa", _isas())
def test_f8_kernel_decodes_every_byte_exactly(kernels, isa: str) -> None:
    """All 254 finite e4m3fn patterns (subnormals, zeros, +-448) read back exactly: one-hot rows of x pick out
    the weight columns, through the few-row tiles (1-8 rows) and the many-row dequantize path."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # the two NaN patterns
    q = codes.view(16, 16).repeat(2, 2)  # [32, 32]: 32 outputs, 32 inputs
    scales = torch.full((32, 1), 0.5)
    panels = QPanels.pack_f8(q.view(torch.float8_e4m3fn), scales)
    expected = (q.view(torch.float8_e4m3fn).float() * 0.5).t()  # y = eye @ W^T = W^T
    eye = torch.eye(32)
    for rows in (range(0, 8), range(8, 32)):
        rows = list(rows)
        y = panels.matmul(eye[rows], isa=ISA_CODES[isa])
        assert torch.equal(y, expected[rows]), rows


def test_quantize_f8_rounds_to_the_nearest_e4m3_value() -> None:
    torch.manual_seed(1)
    w = torch.randn(9, 64)
    q, s = quantize_f8(w, 64)
    assert q.dtype == torch.float8_e4m3fn
    assert float(q.float().abs().max()) == 448.0
    err = (q.float() * s - w).abs()
    # e4m3 keeps 3 mantissa bits: half a step is at most 1/16 of the value (subnormals: 2^-10 * scale).
    assert (err <= w.abs() / 16 * 1.001 + s * 2.0 ** -10).all()


def test_quantizers_round_to_the_nearest_level() -> None:
    torch.manual_seed(0)
    w = torch.randn(33, 128)
    q, s = quantize_q8(w, 128)
    assert (q.float() * s - w).abs().max() <= s.max() / 2 * 1.001
    q4, s4, m4 = quantize_q4(w, 32)
    err = (q4.float().view(33, 4, 32) * s4[..., None] + m4[..., None] - w.view(33, 4, 32)).abs()
    assert (err <= s4[..., None] / 2 * 1.001).all()
    assert int(q4.max()) <= 15


def test_out_buffer_and_strided_rows(kernels) -> None:
    q, s = quantize_q8(torch.randn(24, 64), 32)
    panels = QPanels.pack_q8(q, s)
    x = torch.randn(4, 100)[:, 10:74]  # rows are strided views
    out = torch.empty(4, 24)
    assert panels.matmul(x, out=out) is out
    torch.testing.assert_close(out, F.linear(x, panels.dequantize()), atol=1e-4, rtol=1e-4)


def test_kernels_reject_bad_shapes(kernels) -> None:
    q, s = quantize_q8(torch.randn(20, 64), 32)
    p = QPanels.pack_q8(q, s)
    with pytest.raises(RuntimeError, match="qweight"):
        kernels.q8_gemm(torch.randn(2, 32), p.qweight, p.scales, 32, 20)
    with pytest.raises(RuntimeError, match="group"):
        kernels.q8_gemm(torch.randn(2, 64), p.qweight, p.scales, 48, 20)
    with pytest.raises(RuntimeError, match="isa"):
        kernels.q8_gemm(torch.randn(2, 64), p.qweight, p.scales, 32, 20, isa=7)
    with pytest.raises(RuntimeError, match="uint8"):  # f8 reads bytes: int8 panels are refused
        kernels.f8_gemm(torch.randn(2, 64), p.qweight, p.scales, 32, 20)
    assert kernels.q8_gemm(torch.randn(0, 64), p.qweight, p.scales, 32, 20).shape == (0, 20)


def test_int8_kernel_agrees_with_torch_weight_int8pack_mm(kernels) -> None:
    """torch's own weight-only int8 matmul (the baseline the benchmark compares with) gives the same rows."""
    torch.manual_seed(3)
    q, s = quantize_q8(torch.randn(48, 64), 64)
    x = torch.randn(5, 64)
    ours = QPanels.pack_q8(q, s).matmul(x)
    theirs = torch.ops.aten._weight_int8pack_mm(x, q, s[:, 0].contiguous())
    torch.testing.assert_close(ours, theirs.float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("isa", _isas())
def test_many_rows_span_several_row_blocks(kernels, isa: str) -> None:
    """150 rows x K = 1024: the dequantize-then-fp32 path walks 64-row blocks, with a short last tile."""
    torch.manual_seed(7)
    w = torch.randn(40, 1024)
    x = torch.randn(150, 1024)
    for panels in (QPanels.pack_q8(*quantize_q8(w, 1024)), QPanels.pack_q4(*quantize_q4(w, 64), layout="pairs"),
                   QPanels.pack_f8(*quantize_f8(w, 1024))):
        ref = F.linear(x.double(), panels.dequantize().double()).float()
        torch.testing.assert_close(panels.matmul(x, isa=ISA_CODES[isa]), ref, atol=2e-3, rtol=1e-4)
    # dot8 walks row blocks of ~64 KiB of int8 x: 150 rows x 1024 spans three
    q, s, mins = _fp16_params(*quantize_q4(w, 64))
    torch.testing.assert_close(QPanels.pack_q4(q, s, mins).matmul(x, isa=ISA_CODES[isa]),
                               _int8_activation_reference(x, q, s, mins, 64), atol=3e-3, rtol=1e-5)


def test_w8a8_matches_int8_activations_times_int8_weights(kernels) -> None:
    """W8A8 (VNNI): x quantized per row to int8, int32 sums; K not a multiple of 4, odd N, row blocks."""
    if not kernels.w8a8_supported():
        pytest.skip("this CPU has no AVX-512 VNNI (the W8A8 kernel's only path)")
    torch.manual_seed(11)
    n, k = 37, 70
    q, s = quantize_q8(torch.randn(n, k), k)
    panels = QPanels.pack_q8(q, s)
    bias = torch.randn(n)
    for m in (1, 16, 17, 23, 40, 700):
        x = torch.randn(m, k) * 3
        sx = x.abs().amax(1, keepdim=True) / 127
        xq = torch.round(x / sx).clamp(-127, 127)
        ref = (xq.double() @ q.double().t()) * sx.double() * s.double().t() + bias.double()
        y = kernels.w8a8_gemm(x, panels.qweight, panels.scales, n, bias)
        torch.testing.assert_close(y, ref.float(), atol=1e-4, rtol=1e-5, msg=f"rows {m}")


def test_w8a8_panels_use_the_exact_path_for_few_rows(kernels) -> None:
    torch.manual_seed(12)
    q, s = quantize_q8(torch.randn(20, 64), 64)
    panels = QPanels.pack_w8a8(q, s)
    x = torch.randn(15, 64)
    torch.testing.assert_close(panels.matmul(x), F.linear(x, panels.dequantize()), atol=1e-4, rtol=1e-4)
    x = torch.randn(16, 64)
    # From 16 rows on, VNNI CPUs quantize x: close to the float result, within int8 rounding of x.
    torch.testing.assert_close(panels.matmul(x), F.linear(x, panels.dequantize()), atol=0.1, rtol=0.02)
