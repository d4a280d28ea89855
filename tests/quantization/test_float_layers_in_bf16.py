"""Layers a quantized model keeps in float (a GPTQ/AWQ head, fp8 ignored layers, a GGUF file's float matrices)
run bf16 activations on CUDA through F.linear, which needs weight and bias in the activations' dtype. Checked
on the CPU with the same F.linear call (oneDNN's packed bf16 path, which would hide a mismatch, is turned off)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import unquantized
from pagedllm.model_executor.layers.quantization.gguf import GGUFConfig
from pagedllm.model_executor.layers.quantization.gptq_awq import GPTQConfig
from pagedllm.platforms import cpu_probes


@pytest.fixture(autouse=True)
def plain_f_linear(monkeypatch) -> None:
    monkeypatch.setattr(cpu_probes, "onednn_bf16_available", lambda: False)


def test_float_head_of_a_quantized_model_takes_bf16() -> None:
    layer = Linear(64, 32, bias=True, dtype=torch.bfloat16, quant_config=GPTQConfig(4, 32, False, True),
                   prefix="lm_head")
    assert isinstance(layer.quant_method, unquantized.UnquantizedLinearMethod)
    assert layer.bias.dtype == torch.bfloat16
    with torch.no_grad():
        layer.bias.normal_()
    layer.process_weights_after_loading()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_gguf_float_matrix_follows_the_model_dtype() -> None:
    torch.manual_seed(3)
    w, b = torch.randn(32, 64), torch.randn(32)
    layer = Linear(64, 32, bias=True, dtype=torch.bfloat16, quant_config=GGUFConfig())
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    layer.process_weights_after_loading()
    assert layer.weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    assert "bfloat16" in layer.quant_method.scheme(layer)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.linear(x, w.bfloat16(), b.bfloat16()))
