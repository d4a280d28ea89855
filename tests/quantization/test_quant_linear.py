"""The layer-owned weight seam: ``Linear`` + quantization methods load fused shards and repack after loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import get_quantization_config
from pagedllm.model_executor.layers.quantization.weight_only import Int4Config, Int8Config


def _load_fused(layer: Linear, shards: list[torch.Tensor]) -> None:
    for i, w in enumerate(shards):
        layer.weight.weight_loader(layer.weight, w, i)


def test_unquantized_loads_shards_and_packs() -> None:
    torch.manual_seed(0)
    shards = [torch.randn(n, 48) for n in (32, 8, 8)]
    layer = Linear(48, 48, bias=True, dtype=torch.float32, shard_sizes=(32, 8, 8), prefix="qkv_proj")
    _load_fused(layer, shards)
    biases = [torch.randn(n) for n in (32, 8, 8)]
    for i, b in enumerate(biases):
        layer.bias.weight_loader(layer.bias, b, i)
    w, b = torch.cat(shards), torch.cat(biases)
    assert torch.equal(layer.weight, w)
    layer.process_weights_after_loading()
    x = torch.randn(5, 48)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shape mismatch"):
        Linear(48, 48, shard_sizes=(32, 8, 8)).weight.weight_loader(layer.bias, torch.zeros(9, 48), 1)


@pytest.mark.parametrize("config", [Int8Config(), Int4Config(32), Int4Config(64), Int4Config(128)],
                         ids=lambda c: c.name)
def test_weight_only_layers_match_their_dequantized_weights(config) -> None:
    torch.manual_seed(1)
    shards = [torch.randn(n, 256) for n in (40, 33)]  # odd N: edge panels
    layer = Linear(256, 73, bias=False, dtype=torch.float32, quant_config=config, shard_sizes=(40, 33))
    _load_fused(layer, shards)
    layer.process_weights_after_loading()
    assert layer.weight is None
    w = torch.cat(shards)
    deq = layer.qpanels.dequantize()
    bits = 8 if config.name == "int8" else 4
    # Each weight within half a quantization step of its group's range.
    step = (w.abs().amax(1, keepdim=True) * 2) / (2 ** bits - 1)
    assert ((deq - w).abs() <= step / 2 * 1.01 + 1e-6).all()
    x = torch.randn(9, 256)
    # 4-bit layers quantize x to two int8 terms per group (~16-bit precise): docs/quantization.md
    torch.testing.assert_close(layer(x), F.linear(x, deq), atol=5e-3, rtol=1e-3)
    assert layer.weight_nbytes() < w.numel() * 4 * (0.3 if bits == 8 else 0.25)  # vs float32


def test_int4_lm_head_stays_int8() -> None:
    layer = Linear(64, 10, bias=False, dtype=torch.float32, quant_config=Int4Config(), prefix="lm_head")
    assert layer.quant_method.name.startswith("int8")


def test_group_must_divide_the_inputs() -> None:
    with pytest.raises(ValueError, match="group size 128"):
        Linear(96, 8, dtype=torch.float32, quant_config=Int4Config(128), prefix="down_proj")


def test_quantization_config_choices_and_errors() -> None:
    assert get_quantization_config(None) is None
    assert get_quantization_config("int8").name == "int8"
    assert get_quantization_config("int4-g128").group == 128
    with pytest.raises(ValueError, match="not supported; choose one of"):
        get_quantization_config("int3")
    with pytest.raises(ValueError, match=".gguf"):
        get_quantization_config("gguf")

    class Cfg:
        quantization_config = {"quant_method": "bitsandbytes"}

    with pytest.raises(ValueError, match="bitsandbytes"):
        get_quantization_config(None, Cfg())
    with pytest.raises(ValueError, match="float32"):
        Int8Config().check_dtype(torch.bfloat16)
