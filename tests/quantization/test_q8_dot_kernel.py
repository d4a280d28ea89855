"""q8_dot_gemm (8-bit weights in dot4 blocks, x split into two int8 terms, AVX-512 VNNI or the portable loop)
against an exact model of what it computes, at every row-tile tail, group size and at the integer extremes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import ISA_CODES, cpu_isa, load_cpu_kernels
from pagedllm.model_executor.layers.quantization import kernel_choice
from pagedllm.model_executor.layers.quantization.qpanels import W8A8_ISAS, Int8Dot4Panels, QPanels, quantize_q8

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels did not build here")
ROWS = [1, 2, 3, 4, 5, 7, 9, 17, 40]  # every tail of the 4-row tiles


def _isas() -> list[str]:
    """The portable loop everywhere; the VNNI tiles where this CPU has them (the only ones a CPU without VNNI
    could not run: the autotuner never offers dot4 there)."""
    fast = KERNELS is not None and KERNELS.q8_dot_supported()
    return ["generic"] + (["avx512"] if fast else [])


def _reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """What q8_dot_gemm computes, in float64: x per (row, group) as dx * x1 + dx / 254 * x2 (x1, x2 int8, dx =
    max|x| / 127, x2 the rounding residual of x1), the levels' dot products exact, then the group's scale."""
    m, k = x.shape
    xf = x.float().view(m, k // group, group)
    amax = xf.abs().amax(-1)
    # one float32 division, as the kernel (127 / amax would be reciprocal(amax) * 127: two roundings)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    x1 = torch.round(xf * inv.unsqueeze(-1))
    # the residual of the unrounded product, rounded once to float32 (the kernel's fused multiply-add)
    res = (xf.double() * inv.double().unsqueeze(-1) - x1.double()).float()
    x2 = torch.round(res * 254).clamp(-127, 127)
    qg = q.double().view(-1, k // group, group)
    d = torch.einsum("mgk,ngk->mng", x1.double(), qg) + torch.einsum("mgk,ngk->mng", x2.double(), qg) / 254
    return (d * (amax / 127).double().unsqueeze(1) * s.double().unsqueeze(0)).sum(-1).float()


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize(("n", "k", "group"), [(37, 64, 32), (16, 96, 96), (100, 128, 4), (33, 96, 12),
                                               (5, 576, 576)])
def test_matches_the_int8_activation_reference(isa: str, n: int, k: int, group: int) -> None:
    """Groups of one block (4 k), odd block counts (12 k), whole rows (per-channel int8), odd N, bias."""
    torch.manual_seed(n * k + group)
    q, s = quantize_q8(torch.randn(n, k), group)
    s = s.half().float()  # exact in float16: the layout keeps float16 scales then
    panels = Int8Dot4Panels.pack(q, s)
    assert panels.scales.dtype == torch.float16
    bias = torch.randn(n) if n % 2 else None
    for m in ROWS:
        x = torch.randn(m, k) * 3
        y = panels.matmul(x, bias, isa=ISA_CODES[isa])
        expected = _reference(x, q, s, group) + (0 if bias is None else bias)
        torch.testing.assert_close(y, expected, atol=1e-4 * k ** 0.5, rtol=1e-5, msg=f"rows {m}")
        # and, with x's two int8 terms, close to the float product
        torch.testing.assert_close(y, F.linear(x, panels.dequantize(), bias), atol=1e-3 * k ** 0.5, rtol=1e-3)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("level", [127, -127, -128])
def test_integer_sums_at_their_extremes_do_not_wrap(isa: str, level: int) -> None:
    """Every weight at an end of int8 (stored as 255, 1 or 0 after the +128 offset) against x whose two terms are
    both near +-127, over a 2048-wide group: the largest sums the int32 lanes take."""
    n, k = 32, 2048
    q = torch.full((n, k), level, dtype=torch.int8)
    s = torch.full((n, 1), 0.001)
    panels = Int8Dot4Panels.pack(q, s)
    row = torch.full((k,), 126.5 / 127)
    row[0] = 1.0  # max|x|: x1 = 127 there, 126 with a residual of ~127 elsewhere
    for sign in (1.0, -1.0):
        x = (2.0 * sign * row).expand(4, k).contiguous()
        y = panels.matmul(x, None, isa=ISA_CODES[isa])
        torch.testing.assert_close(y, _reference(x, q, s, k), atol=1e-4 * k ** 0.5, rtol=1e-5)


def test_dot4_holds_the_same_weight_as_the_int8_panels() -> None:
    torch.manual_seed(5)
    q, s = quantize_q8(torch.randn(21, 64), 32)
    panels, dot4 = QPanels.pack_q8(q, s), Int8Dot4Panels.pack(q, s)
    assert dot4.qweight.shape == (2, 16, 64) and dot4.qweight.dtype == torch.uint8
    assert dot4.scales.dtype == torch.float32  # these scales are not exact in float16: kept as they are
    torch.testing.assert_close(dot4.dequantize(), panels.dequantize(), atol=0, rtol=0)
    half = Int8Dot4Panels.pack(q, s.half().float())
    assert half.scales.dtype == torch.float16 and half.nbytes() == 2 * 16 * (64 + 2 * 2)
    with pytest.raises(ValueError, match="multiple of 4"):
        Int8Dot4Panels.pack(*quantize_q8(torch.randn(4, 36), 6))


def test_rows_are_independent_of_the_batch() -> None:
    """Each row's activations are split on their own: a row's result is the same alone and in a batch."""
    torch.manual_seed(6)
    dot4 = Int8Dot4Panels.pack(*quantize_q8(torch.randn(50, 128), 32))
    x = torch.randn(37, 128)
    batched = dot4.matmul(x)
    for i in (0, 5, 36):
        assert torch.equal(dot4.matmul(x[i:i + 1]), batched[i:i + 1])


def test_the_kernel_rejects_bad_arguments() -> None:
    dot4 = Int8Dot4Panels.pack(*quantize_q8(torch.randn(20, 64), 32))
    with pytest.raises(RuntimeError, match="isa"):
        KERNELS.q8_dot_gemm(torch.randn(2, 64), dot4.qweight, dot4.scales, 32, 20, isa=1)  # no AVX2 path
    with pytest.raises(RuntimeError, match="qweight"):
        KERNELS.q8_dot_gemm(torch.randn(2, 64), dot4.qweight, dot4.scales, 32, 40)
    with pytest.raises(RuntimeError, match="multiple of 4"):
        KERNELS.q8_dot_gemm(torch.randn(2, 64), dot4.qweight, dot4.scales, 6, 20)
    with pytest.raises(RuntimeError, match="float32"):
        KERNELS.q8_dot_gemm(torch.randn(2, 64).double(), dot4.qweight, dot4.scales, 32, 20)


def test_the_autotuner_offers_dot4_exactly_where_vnni_runs_it() -> None:
    weight = QPanels.pack_q8(*quantize_q8(torch.randn(40, 64), 32))
    names = set(kernel_choice.candidates(weight))
    vnni = KERNELS.q8_dot_supported() and cpu_isa() in W8A8_ISAS  # not where PAGEDLLM_CPU_ISA holds them to AVX2
    assert ("dot4/avx512" in names) == vnni
    # besides VNNI, only AMX tiles (where the CPU has them and no ISA is forced: test_amx_dot_kernel.py)
    want = {"dot4/avx512"} if vnni else set()
    if vnni and KERNELS.amx_dot_supported() and not cpu_isa():
        want.add("dot4/amx")
    assert {name for name in names if name.startswith("dot4/") and "words" not in name} == want
