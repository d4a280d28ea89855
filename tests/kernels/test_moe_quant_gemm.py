"""The quantized MoE experts kernel (``moe_quant_gemm``): each panel layout stacked over experts against the same
experts' dense quantized matmul run one by one, at decode and prefill row counts (the widening tiles' dequantized
path from 9 rows), experts with no rows, every ISA this CPU runs, and its argument checks."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import ISA_CODES, load_cpu_kernels
from pagedllm.model_executor.layers.fused_moe.stacked import LAYOUTS, stack_projection
from pagedllm.model_executor.layers.quantization.qpanels import (
    Int8Dot4Panels,
    QPanels,
    quantize_f8,
    quantize_q4,
    quantize_q8,
)

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels did not build here")
GROUP = 32


class _Layer:
    """What ``stack_projection`` reads of an expert's ``Linear``: its packed weight and bias."""

    def __init__(self, packed: QPanels) -> None:
        self.packed, self.bias = packed, None


def _pack(kind: str, w: torch.Tensor) -> QPanels:
    if kind == "q8":
        return QPanels.pack_q8(*quantize_q8(w, GROUP))
    if kind == "f8":
        return QPanels.pack_f8(*quantize_f8(w, GROUP))
    if kind == "dot4":
        q, s = quantize_q8(w, GROUP)
        return Int8Dot4Panels.pack(q, s.half().float())
    q, s, mins = quantize_q4(w, GROUP)
    return QPanels.pack_q4(q, s.half().float(), mins.half().float(), "pairs" if kind == "pairs" else "dot8")


def _isas() -> list[str]:
    supported = set(KERNELS.supported_isas()) if KERNELS is not None else set()
    return [name for name, code in ISA_CODES.items() if code in supported and code != 0]


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("kind", ["q8", "pairs", "f8", "dot8", "dot4"])
@pytest.mark.parametrize("counts", [[1, 0, 0, 2], [0, 0, 1, 0, 1, 0, 0, 1], [12, 0, 3, 30]])
def test_stacked_experts_equal_each_expert_alone(isa: str, kind: str, counts: list[int]) -> None:
    torch.manual_seed(len(counts) + sum(counts))
    n, k = 40, 96  # a panel tail (40 = 2 x 16 + 8), three groups
    experts = [_pack(kind, torch.randn(n, k)) for _ in counts]
    stacked = stack_projection([_Layer(p) for p in experts])
    assert stacked is not None and stacked.layout == LAYOUTS[type(experts[0])]
    assert torch.equal(stacked.expert(len(counts) - 1).dequantize(), experts[-1].dequantize())
    x = torch.randn(sum(counts), k)
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    got = KERNELS.moe_quant_gemm(x, stacked.qweight, stacked.scales, stacked.mins, stacked.layout, GROUP, n, ends,
                                 isa=ISA_CODES[isa])
    start = 0
    for expert, rows in enumerate(counts):
        if rows:
            want = experts[expert].matmul(x[start:start + rows], isa=ISA_CODES[isa])
            torch.testing.assert_close(got[start:start + rows], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        start += rows


def test_experts_of_different_forms_are_not_stacked() -> None:
    w = torch.randn(32, 64)
    assert stack_projection([_Layer(_pack("q8", w)), _Layer(_pack("dot8", w))]) is None
    assert stack_projection([_Layer(_pack("q8", w)), _Layer(_pack("q8", torch.randn(48, 64)))]) is None


def test_arguments_are_checked() -> None:
    experts = [_pack("q8", torch.randn(32, 64)) for _ in range(3)]
    s = stack_projection([_Layer(p) for p in experts])
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="ends"):  # the runs do not cover x's rows
        KERNELS.moe_quant_gemm(x, s.qweight, s.scales, s.mins, s.layout, GROUP, 32, torch.tensor([1, 2, 3],
                                                                                                 dtype=torch.int32))
    with pytest.raises(RuntimeError, match="experts"):
        KERNELS.moe_quant_gemm(x, s.qweight, s.scales, s.mins, s.layout, GROUP, 32, torch.tensor([4, 4],
                                                                                                 dtype=torch.int32))
    with pytest.raises(RuntimeError, match="qweight"):  # the layout code of another format
        KERNELS.moe_quant_gemm(x, s.qweight, s.scales, s.mins, 3, GROUP, 32, torch.tensor([1, 2, 4],
                                                                                          dtype=torch.int32))
    with pytest.raises(RuntimeError, match="layout"):
        KERNELS.moe_quant_gemm(x, s.qweight, s.scales, s.mins, 9, GROUP, 32, torch.tensor([1, 2, 4],
                                                                                          dtype=torch.int32))
