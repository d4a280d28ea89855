"""One packed-weight class per format, its kernel bound once at packing: each format's bound matmul against
dequantize-then-matmul, the platform choosing the family, the W8A8 routing, the fallback without kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import triton_quant_matmul as tqm
from pagedllm.kernels.cpu import ISA_CODES, cpu_isa, load_cpu_kernels
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization.layouts import layout_for
from pagedllm.model_executor.layers.quantization.packed_weight import PackedWeight
from pagedllm.model_executor.layers.quantization.qpanels import (
    W8A8_ISAS,
    W8A8_MIN_ROWS,
    Fp8Panels,
    Int8Panels,
    Q4Dot8Panels,
    Q4PairsPanels,
    QPanels,
    W8A8Panels,
    quantize_f8,
    quantize_q4,
    quantize_q8,
)
from pagedllm.model_executor.layers.quantization.qrows import Fp8Rows, Int8Rows, Q4Rows, QRows
from pagedllm.model_executor.layers.quantization.weight_only import Int4Config, Int8Config
from pagedllm.platforms import platform_for

N, K = 37, 128


def _panels() -> dict[str, tuple[type[PackedWeight], QPanels]]:
    torch.manual_seed(0)
    w = torch.randn(N, K)
    return {
        "int8": (Int8Panels, QPanels.pack_q8(*quantize_q8(w, 32))),
        "w8a8": (W8A8Panels, QPanels.pack_w8a8(*quantize_q8(w, K))),
        "q4 dot8": (Q4Dot8Panels, QPanels.pack_q4(*quantize_q4(w, 32))),
        "q4 pairs": (Q4PairsPanels, QPanels.pack_q4(*quantize_q4(w, 32), layout="pairs")),
        "fp8": (Fp8Panels, QPanels.pack_f8(*quantize_f8(w, 64))),
    }


def _activations_as_the_kernel_sees_them(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """W8A8 on a VNNI CPU quantizes x per row to int8 from ``W8A8_MIN_ROWS`` rows on (unless PAGEDLLM_CPU_ISA holds
    the kernels to AVX2, which has no such path); the others take x as is."""
    if fmt != "w8a8" or x.shape[0] < W8A8_MIN_ROWS or not load_cpu_kernels().w8a8_supported() or \
            cpu_isa() not in W8A8_ISAS:
        return x
    sx = x.abs().amax(1, keepdim=True) / 127
    return torch.round(x / sx).clamp(-127, 127) * sx


@pytest.mark.parametrize("fmt", list(_panels()))
def test_each_panel_format_binds_its_kernel_once(fmt: str) -> None:
    assert load_cpu_kernels() is not None, "the C++ CPU kernels must build on the test machine"
    cls, panels = _panels()[fmt]
    assert type(panels) is cls
    kernel = panels.cpu_matmul()
    assert kernel is not None and panels.cpu_matmul() is kernel  # bound at packing, not per call
    w = panels.dequantize()
    bias = torch.randn(N)
    for m in (1, 5, 17):
        x = torch.randn(m, K)
        y = kernel(x, bias, None)
        assert y.shape == (m, N)
        # q4 dot8 multiplies x split in two int8 terms per group (docs/quantization.md): ~16-bit precise
        ref = F.linear(_activations_as_the_kernel_sees_them(fmt, x), w, bias)
        torch.testing.assert_close(y, ref, atol=2e-3 * K ** 0.5, rtol=1e-3)
        assert torch.equal(panels.matmul(x, bias), y)  # matmul runs the same bound call
        assert torch.equal(panels.matmul(x, bias, isa=cpu_isa()), y)  # as a kernel bound for the default ISA


def test_packed_weights_hold_tensors_and_shape_only() -> None:
    """No flag fields: what a weight does is its class; frozen, since its kernel holds its tensors."""
    names = [f.name for f in dataclasses.fields(PackedWeight)]
    assert names == ["qweight", "scales", "mins", "group", "out_features", "in_features", "_kernel"]
    _, panels = _panels()["int8"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        panels.group = 64  # type: ignore[misc]


@pytest.mark.parametrize("fmt", list(_panels()))
def test_without_kernels_a_weight_falls_back_to_its_dequantized_product(fmt: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform_for("cpu"), "cpu_kernels", lambda dtype, dtypes=(torch.float32,): None)
    _, panels = _panels()[fmt]
    assert panels.cpu_matmul() is None
    x, bias = torch.randn(3, K), torch.randn(N)
    assert torch.equal(panels.matmul(x, bias), F.linear(x, panels.dequantize(), bias))


class _FakeVnniKernels:
    """Records which C++ call a W8A8 weight makes (the test machine may lack VNNI)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def w8a8_supported(self) -> bool:
        return True

    def w8a8_gemm(self, x, qweight, scales, n, bias=None, out=None):  # noqa: ANN001, ANN201 - the C++ signature
        self.calls.append(("w8a8_gemm", x.shape[0]))
        return torch.zeros(x.shape[0], n)

    def q8_gemm(self, x, qweight, scales, group, n, bias=None, out=None, isa=0):  # noqa: ANN001, ANN201
        self.calls.append(("q8_gemm", isa))
        return torch.zeros(x.shape[0], n)


def test_w8a8_quantizes_activations_from_16_rows_on_vnni_isas(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeVnniKernels()
    monkeypatch.setattr(platform_for("cpu"), "cpu_kernels", lambda dtype, dtypes=(torch.float32,): fake)
    q, s = quantize_q8(torch.randn(N, K), K)
    w8a8 = QPanels.pack_w8a8(q, s)
    auto, avx2, avx512 = ISA_CODES["auto"], ISA_CODES["avx2"], ISA_CODES["avx512"]
    w8a8.matmul(torch.randn(W8A8_MIN_ROWS - 1, K), isa=auto)
    w8a8.matmul(torch.randn(W8A8_MIN_ROWS, K), isa=auto)
    w8a8.matmul(torch.randn(40, K), isa=avx512)
    w8a8.matmul(torch.randn(40, K), isa=avx2)  # the VNNI kernel has no AVX2 path
    QPanels.pack_q8(q, s).matmul(torch.randn(40, K), isa=auto)  # weight-only int8 never quantizes x
    assert fake.calls == [("q8_gemm", auto), ("w8a8_gemm", W8A8_MIN_ROWS), ("w8a8_gemm", 40), ("q8_gemm", avx2),
                          ("q8_gemm", auto)]


@pytest.mark.skipif(not tqm.triton_available(), reason="triton is a test dependency")
def test_each_row_format_binds_the_triton_launch() -> None:
    """On the CPU the tests run Triton's interpreter (tests/conftest.py), which the CPU platform runs."""
    torch.manual_seed(1)
    w = torch.randn(N, K)
    cases = [(Int8Rows, QRows.pack_q8(*quantize_q8(w, 32))), (Int8Rows, QRows.pack_w8a8(*quantize_q8(w, K))),
             (Q4Rows, QRows.pack_q4(*quantize_q4(w, 32))), (Fp8Rows, QRows.pack_f8(*quantize_f8(w, 64)))]
    x, bias = torch.randn(5, K), torch.randn(N)
    for cls, rows in cases:
        assert type(rows) is cls and rows.cpu_matmul() is None  # no C++ kernel reads rows
        torch.testing.assert_close(rows.matmul(x, bias), F.linear(x, rows.dequantize(), bias), atol=1e-4 * K ** 0.5,
                                   rtol=1e-4)


def test_the_platform_picks_the_family() -> None:
    assert layout_for(torch.zeros(1)) is QPanels
    assert layout_for(torch.zeros(1, device="meta")) is QPanels  # portable: panels, no kernel bound


@pytest.mark.skipif(not tqm.triton_available(), reason="triton is a test dependency")
@pytest.mark.parametrize(("config", "cls"), [(Int8Config(), Int8Rows), (Int4Config(32), Q4Rows)])
def test_a_platform_that_packs_by_rows_gets_rows(config, cls, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform_for("cpu"), "packs_quantized_by_rows", True)
    torch.manual_seed(2)
    layer = Linear(K, N, bias=True, dtype=torch.float32, quant_config=config)
    layer.weight.weight_loader(layer.weight, torch.randn(N, K))
    layer.process_weights_after_loading()
    assert type(layer.qpanels) is cls and layer.packed.cpu_matmul() is None
    x = torch.randn(3, K)
    torch.testing.assert_close(layer(x), F.linear(x, layer.qpanels.dequantize(), layer.bias), atol=1e-3, rtol=1e-3)


def test_a_quantized_linear_calls_its_weights_bound_kernel() -> None:
    layer = Linear(K, N, bias=False, dtype=torch.float32, quant_config=Int8Config())
    layer.weight.weight_loader(layer.weight, torch.randn(N, K))
    layer.process_weights_after_loading()
    assert layer.packed is layer.qpanels and layer.packed.cpu_matmul() is not None
    assert layer.weight_nbytes() == layer.qpanels.nbytes()  # the method counts its packed weight
