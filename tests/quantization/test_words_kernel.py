"""The words tiles of the byte-dot layouts (kernels/csrc/words_gemm.h: dot8 / dot4 panels widened to int16 pairs,
x as one int16 term): against the float product of the dequantized weight and against the byte tiles, on every ISA
this CPU runs, at every row and panel tail, for each group size and the LM head's shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import ISA_CODES, load_cpu_kernels
from pagedllm.model_executor.layers.quantization import kernel_choice
from pagedllm.model_executor.layers.quantization.qpanels import (
    WORDS,
    WORDS_MAX_GROUP,
    Int8Dot4Panels,
    QPanels,
    quantize_q4,
    quantize_q8,
)

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels did not build here")
ROWS = [1, 6, 7, 17, 64, 256]  # the 6-row tiles' tails (AVX-512), 4-row ones (AVX2), many rows


def _isas() -> list[str]:
    supported = set(KERNELS.supported_isas()) if KERNELS is not None else set()
    return [name for name, code in ISA_CODES.items() if code in supported and code != 0]


def _q4(n: int, k: int, group: int) -> QPanels:
    q, s, mins = quantize_q4(torch.randn(n, k), group)
    return QPanels.pack_q4(q, s.half().float(), mins.half().float(), "dot8")  # float16-exact, as GGUF's


def _q8(n: int, k: int, group: int) -> Int8Dot4Panels:
    q, s = quantize_q8(torch.randn(n, k), group)
    return Int8Dot4Panels.pack(q, s.half().float())


def _close(y: torch.Tensor, reference: torch.Tensor, k: int, rtol: float) -> None:
    torch.testing.assert_close(y, reference, rtol=rtol, atol=rtol * k ** 0.5 * reference.abs().max().item())


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize(("fmt", "n", "k", "group"), [
    ("q4", 48, 64, 32), ("q4", 37, 96, 32), ("q4", 100, 128, 64), ("q4", 20, 256, 128),  # odd panels, N % 16
    ("q8", 48, 64, 32), ("q8", 33, 96, 32), ("q8", 16, 512, 256),  # the largest 8-bit group they take
    ("q4", 1000, 64, 32), ("q8", 1000, 64, 32),  # an LM head's shape: many panels, few k
])
def test_words_equal_the_byte_tiles_and_the_float_product(isa: str, fmt: str, n: int, k: int, group: int) -> None:
    torch.manual_seed(n + k + group)
    weight = _q4(n, k, group) if fmt == "q4" else _q8(n, k, group)
    dense = weight.dequantize()
    bias = torch.randn(n) if n % 2 else None
    for m in ROWS:
        x = torch.randn(m, k) * 2
        words = weight.matmul(x, bias, isa=ISA_CODES[isa] | WORDS)
        # The byte tiles compute the same real number from the same two int8 terms of x, rounded differently.
        _close(words, weight.matmul(x, bias, isa=ISA_CODES[isa]), k, 1e-5)
        # x's two int8 terms keep ~16 bits: close to the float product
        _close(words, F.linear(x, dense, bias), k, 1e-3)
        if m > 1:  # a row's result does not depend on the rows beside it
            _close(words[-1:], weight.matmul(x[-1:], bias, isa=ISA_CODES[isa] | WORDS), k, 1e-6)


def test_out_rows_and_outputs_that_bypass_the_caches() -> None:
    """``out=`` with strided rows; an output over 16 MiB (the LM head's logits at many rows) is written past the
    caches and must hold the same values."""
    torch.manual_seed(0)
    weight = _q8(16400, 32, 32)
    x = torch.randn(256, 32)
    big = weight.matmul(x, isa=WORDS)  # 256 x 16400 floats: 16.8 MB
    torch.testing.assert_close(big[:8], weight.matmul(x[:8], isa=WORDS), rtol=0, atol=0)
    small = _q4(40, 64, 32)
    out = torch.full((9, 50), 7.0)
    xs = torch.randn(9, 64)
    small.matmul(xs, out=out[:, 3:43], isa=WORDS)
    torch.testing.assert_close(out[:, 3:43], small.matmul(xs, isa=WORDS), rtol=0, atol=0)
    assert (out[:, :3] == 7).all() and (out[:, 43:] == 7).all()


def test_groups_the_words_tiles_cannot_sum_exactly_are_refused() -> None:
    big_group = _q8(16, 512, 512)
    with pytest.raises(RuntimeError, match="at most 256"):
        big_group.matmul(torch.randn(2, 512), isa=WORDS)
    q4 = _q4(16, 64, 32)
    with pytest.raises(RuntimeError, match="isa"):
        KERNELS.q4_dot_gemm(torch.randn(2, 64), q4.qweight, q4.scales, q4.mins, 32, 16, isa=4 | WORDS)


def test_the_autotuner_offers_words_tiles_for_groups_they_take() -> None:
    isas = [kernel_choice.ISA_NAMES[i] for i in kernel_choice._isas(KERNELS)]
    q4 = QPanels.pack_q4(*quantize_q4(torch.randn(32, 128), 32))
    assert {f"dot8/words-{isa}" for isa in isas} <= set(kernel_choice.candidates(q4))
    q8 = QPanels.pack_q8(*quantize_q8(torch.randn(32, 128), 32))
    assert {f"dot4/words-{isa}" for isa in isas} <= set(kernel_choice.candidates(q8))  # with or without VNNI
    per_channel = QPanels.pack_q8(*quantize_q8(torch.randn(32, 512), 512))
    assert 512 > WORDS_MAX_GROUP["dot4"]
    assert not any("words" in name for name in kernel_choice.candidates(per_channel))
