"""The CUDA weight-only path (Triton kernel over the row layout, ``QRows``) against dequantize-then-matmul,
through Triton's interpreter on the CPU; on a GPU machine run with PAGEDLLM_TEST_DEVICE=cuda TRITON_INTERPRET=0."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedllm.kernels import triton_quant_matmul as tqm  # noqa: E402
from pagedllm.model_executor.layers.linear import Linear  # noqa: E402
from pagedllm.model_executor.layers.quantization.qpanels import (  # noqa: E402
    QPanels,
    quantize_f8,
    quantize_q4,
    quantize_q8,
)
from pagedllm.model_executor.layers.quantization.qrows import QRows  # noqa: E402
from pagedllm.model_executor.layers.quantization.weight_only import Int4Config, Int8Config  # noqa: E402

pytestmark = pytest.mark.skipif(not tqm.triton_available(), reason="triton is a test dependency")


def _pack(kind: str, w: torch.Tensor, group: int) -> tuple[QRows, QPanels]:
    """The same quantized weight by rows (on the test device) and in CPU panels."""
    quantize = {"q8": quantize_q8, "q4": quantize_q4, "f8": quantize_f8}[kind]
    parts = quantize(w, group)
    on_device = [t.to(DEVICE) for t in parts]
    if kind == "q8":
        return QRows.pack_q8(*on_device), QPanels.pack_q8(*parts)
    if kind == "q4":
        return QRows.pack_q4(*on_device), QPanels.pack_q4(*parts, layout="pairs")
    return QRows.pack_f8(*on_device), QPanels.pack_f8(*parts)


@pytest.mark.parametrize("kind", ["q8", "q4", "f8"])
@pytest.mark.parametrize(("n", "k", "group"), [(40, 96, 32), (17, 64, 16), (70, 128, 128), (33, 80, 80)])
def test_rows_hold_the_panels_weights_and_multiply_like_them(kind: str, n: int, k: int, group: int) -> None:
    """Same quantized integers in either layout; the kernel matches dequantize-then-matmul for decode-sized and
    prefill-sized M, odd N, per-channel (group = K) and grouped scales, with and without bias."""
    torch.manual_seed(n + k)
    rows, panels = _pack(kind, torch.randn(n, k), group)
    w = rows.dequantize().cpu()
    torch.testing.assert_close(w, panels.dequantize(), atol=0, rtol=0)
    assert rows.is_q4 == (kind == "q4") and rows.cpu_matmul() is None
    for m in (1, 5, 40):
        x = torch.randn(m, k)
        bias = torch.randn(n) if m == 5 else None
        y = rows.matmul(x.to(DEVICE), None if bias is None else bias.to(DEVICE))
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.cpu(), F.linear(x, w, bias), atol=1e-4 * k ** 0.5, rtol=1e-4)


def test_bf16_activations_give_bf16_outputs() -> None:
    torch.manual_seed(0)
    rows, _ = _pack("q4", torch.randn(48, 64), 32)
    x = torch.randn(3, 64)
    y = rows.matmul(x.bfloat16().to(DEVICE))
    assert y.dtype == torch.bfloat16
    ref = F.linear(x.bfloat16().float(), rows.dequantize().cpu())
    torch.testing.assert_close(y.float().cpu(), ref, atol=0.02 * ref.abs().max().item(), rtol=0.02)


def test_out_buffer_is_written() -> None:
    torch.manual_seed(1)
    rows, _ = _pack("q8", torch.randn(20, 32), 32)
    x = torch.randn(4, 32)
    out = torch.empty(4, 20, device=DEVICE)
    assert rows.matmul(x.to(DEVICE), None, out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.cpu(), F.linear(x, rows.dequantize().cpu()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config", [Int8Config(), Int4Config(32)])
def test_a_quantized_linear_runs_on_the_row_layout(config) -> None:
    """The quantization methods' ``apply`` serves either layout (on CUDA the methods pack ``QRows``)."""
    torch.manual_seed(2)
    layer = Linear(64, 48, bias=True, dtype=torch.float32, quant_config=config)
    layer.weight.weight_loader(layer.weight, torch.randn(48, 64))
    layer.bias.weight_loader(layer.bias, torch.randn(48))
    layer.process_weights_after_loading()
    x = torch.randn(6, 64)
    expected = layer(x)
    # Re-pack the same weights by rows, as process_weights_after_loading does for a layer on CUDA (where no
    # CPU kernel is bound either).
    panels = layer.qpanels
    w = panels.dequantize()
    layer.bind_weight(QRows.pack_q4(*quantize_q4(w, panels.group)) if panels.is_q4
                      else QRows.pack_q8(*quantize_q8(w, panels.group)))  # as layer.qpanels
    assert layer.quant_method.cpu_matmul(layer) is None
    torch.testing.assert_close(layer(x), F.linear(x, layer.qpanels.dequantize(), layer.bias), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(layer(x), expected, atol=0.05 * expected.abs().max().item(), rtol=0.05)


def test_groups_the_kernel_cannot_tile_fail_at_load() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        QRows.pack_q8(*quantize_q8(torch.randn(4, 48), 8))


def test_cuda_accepts_half_precision_activations_the_cpu_does_not() -> None:
    Int8Config().check_dtype(torch.bfloat16, "cuda")
    Int8Config().check_dtype(torch.float16, "cuda")
    with pytest.raises(ValueError, match="float32 activations on the CPU"):
        Int8Config().check_dtype(torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="on CUDA runs"):
        Int8Config().check_dtype(torch.float64, "cuda")


@pytest.mark.skipif(DEVICE != "cpu", reason="the architecture is the GPU's own there")
def test_fp8_weights_decode_by_hand_before_ada(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUs before sm_89 (A100) have no e4m3 conversion: the kernel decodes the bits itself, exactly, every
    exponent (subnormals included) and both signs."""
    monkeypatch.setenv("PAGEDLLM_TRITON_ARCH", "80")
    torch.manual_seed(3)
    w = torch.randn(40, 96) * torch.logspace(-4, 2, 96)  # spans e4m3's subnormals up to its largest values
    rows, _ = _pack("f8", w, 32)
    assert (rows.qweight & 0x78 == 0).any() and (rows.qweight & 0x80 != 0).any()  # subnormals and negatives
    x = torch.randn(5, 96)
    torch.testing.assert_close(rows.matmul(x), F.linear(x, rows.dequantize()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["q8", "q4", "f8"])
@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_sums_to_the_same_product(kind: str, split_k: int) -> None:
    """Decode-sized products split over K (uneven splits, a bias added once, an out buffer) match
    dequantize-then-matmul."""
    torch.manual_seed(split_k)
    rows, _ = _pack(kind, torch.randn(70, 336), 16)
    w = rows.dequantize().cpu()
    bias = torch.randn(70)
    for m in (1, 7):
        x = torch.randn(m, 336)
        out = torch.empty(m, 70, device=DEVICE)
        y = tqm.weight_only_matmul(x.to(DEVICE), rows.qweight, rows.scales, rows.mins, rows.group, rows.out_features,
                                   rows.kind, bias.to(DEVICE), out, split_k=split_k)
        assert y.data_ptr() == out.data_ptr()
        torch.testing.assert_close(y.cpu(), F.linear(x, w, bias), atol=1e-4 * 336 ** 0.5, rtol=1e-4)


def test_split_k_count() -> None:
    assert tqm.split_k_for(9, 18, 132) == 4  # N = 576 at batch 1, K = 576 in 32-wide tiles: 18 // 4 tiles
    assert tqm.split_k_for(9, 96, 132) == 16  # a long K: as many splits as allowed
    assert tqm.split_k_for(300, 96, 132) == 1  # the grid already fills the GPU
    assert tqm.split_k_for(9, 6, 132) == 1  # too short to split
