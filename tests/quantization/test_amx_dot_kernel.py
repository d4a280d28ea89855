"""The byte-dot-product matmuls on AMX tiles (isa 4, kernels/csrc/amx_dot_gemm.cpp) give exactly the VNNI tiles'
floats: the same int8 terms, the same integer sums, scaled by the same operations. So the autotuner's choice between
them changes speed only. Runs where the CPU has AMX tiles (an Intel Xeon since Sapphire Rapids); elsewhere the
kernel tests skip with that reason, and the autotuner test checks that AMX is never offered."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import load_cpu_kernels
from pagedllm.model_executor.layers.quantization import kernel_choice
from pagedllm.model_executor.layers.quantization.qpanels import (
    AMX_ISA,
    Int8Dot4Panels,
    QPanels,
    quantize_q4,
    quantize_q8,
)

KERNELS = load_cpu_kernels()
AMX = KERNELS is not None and KERNELS.amx_dot_supported()
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles (AMX-INT8), or Linux refused the tile "
                                                 "state: the AVX-512 VNNI / AVX2 paths are tested on it instead")
ROWS = [1, 2, 15, 16, 17, 31, 33, 40]  # the 16-row tile passes and their tails
VNNI = 2


def _q4_dot8(n: int, k: int, group: int) -> QPanels:
    q, s, mins = quantize_q4(torch.randn(n, k), group)
    return QPanels.pack_q4(q, s.half().float(), mins.half().float(), layout="dot8")


def _q8_dot4(n: int, k: int, group: int) -> QPanels:
    """float16 scales (as GGUF's Q8_0) for groups under 96, float32 ones (not exact in float16) otherwise."""
    q, s = quantize_q8(torch.randn(n, k), group)
    weight = Int8Dot4Panels.pack(q, s.half().float() if group < 96 else s)
    assert (weight.scales.dtype == torch.float16) == (group < 96)
    return weight


@needs_amx
@pytest.mark.parametrize(("make", "n", "k", "group"), [
    (_q4_dot8, 37, 64, 32),    # GGUF's 32-k blocks, a last panel of 5 columns
    (_q4_dot8, 48, 96, 8),     # one 8-k block per group: tile passes of 8 k
    (_q4_dot8, 16, 576, 64),   # 64-k passes
    (_q4_dot8, 33, 384, 128),  # two 64-k passes per group
    (_q8_dot4, 40, 96, 12),    # 12-k passes
    (_q8_dot4, 100, 128, 4),   # 4-k passes
    (_q8_dot4, 17, 576, 576),  # whole rows: nine 64-k passes summed in the tiles
    (_q8_dot4, 16, 96, 96),    # float32 scales
])
def test_amx_equals_the_vnni_tiles(make, n: int, k: int, group: int) -> None:
    torch.manual_seed(n * k + group)
    weight = make(n, k, group)
    bias = torch.randn(n) if n % 2 else None
    for m in ROWS:
        x = torch.randn(m, k) * 3
        assert torch.equal(weight.matmul(x, bias, isa=AMX_ISA), weight.matmul(x, bias, isa=VNNI)), f"rows {m}"


@needs_amx
@pytest.mark.parametrize("level", [127, -128])
def test_integer_sums_at_their_extremes_equal_the_vnni_tiles(level: int) -> None:
    """int8 weights at an end of their range (255 or 0 after the +128 offset) against x whose two terms sit near
    +-127, over a 2048-wide group: the largest sums a tile accumulates (32 passes of 64 k)."""
    n, k = 32, 2048
    weight = Int8Dot4Panels.pack(torch.full((n, k), level, dtype=torch.int8), torch.full((n, 1), 0.001))
    row = torch.full((k,), 126.5 / 127)
    row[0] = 1.0
    for sign in (1.0, -1.0):
        x = (2.0 * sign * row).expand(20, k).contiguous()
        assert torch.equal(weight.matmul(x, None, isa=AMX_ISA), weight.matmul(x, None, isa=VNNI))


@needs_amx
def test_strided_rows_and_an_out_buffer() -> None:
    torch.manual_seed(3)
    weight = _q4_dot8(64, 128, 32)
    x = torch.randn(40, 256)[:, :128]  # rows 256 floats apart
    out = torch.empty(40, 64)
    got = weight.matmul(x, None, out=out, isa=AMX_ISA)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, weight.matmul(x.contiguous(), None, isa=VNNI))


@pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels did not build here")
def test_the_autotuner_offers_amx_exactly_for_the_byte_dot_layouts_where_it_runs() -> None:
    q4 = QPanels.pack_q4(*quantize_q4(torch.randn(40, 64), 32))
    q8 = QPanels.pack_q8(*quantize_q8(torch.randn(40, 64), 32))
    names = set(kernel_choice.candidates(q4)) | set(kernel_choice.candidates(q8))
    amx = {name for name in names if name.endswith("/amx")}
    want = {"dot8/amx"} | ({"dot4/amx"} if KERNELS.q8_dot_supported() else set())
    assert amx == (want if AMX else set())


def test_a_forced_amx_choice_binds_this_cpus_best_where_there_are_no_tiles() -> None:
    from types import SimpleNamespace

    from pagedllm.model_executor.layers.quantization.qpanels import _present_isa

    without = SimpleNamespace(amx_dot_supported=lambda: False)
    with_tiles = SimpleNamespace(amx_dot_supported=lambda: True)
    assert _present_isa(without, AMX_ISA) == 0 and _present_isa(with_tiles, AMX_ISA) == AMX_ISA
    assert _present_isa(without, 2) == 2
