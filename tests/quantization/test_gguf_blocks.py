"""GGUF blocks kept quantized: our decoding + packing reproduces ``gguf.quants.dequantize`` exactly, and the
GGUF linear method packs fused shards (and mixed block types) correctly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization.gguf import GGUFConfig, GGUFQuantTensor
from pagedllm.model_executor.layers.quantization.qpanels import QPanels

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def _quant(rows: int, k: int, qtype: GGMLQuantizationType, seed: int = 0) -> GGUFQuantTensor:
    w = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    return GGUFQuantTensor(torch.from_numpy(quantize(w, qtype)), int(qtype), (rows, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_linear_matches_gguf_dequantize(qtype: GGMLQuantizationType) -> None:
    shards = [_quant(40, 96, qtype, 1), _quant(24, 96, qtype, 2), _quant(24, 96, qtype, 3)]
    layer = Linear(96, 88, bias=False, dtype=torch.float32, quant_config=GGUFConfig(), shard_sizes=(40, 24, 24),
                   prefix="qkv")
    for i, s in enumerate(shards):
        layer.weight.weight_loader(layer.weight, s, i)
    layer.process_weights_after_loading()
    assert layer.weight is None and isinstance(layer.qpanels, QPanels)
    assert layer.quant_method.scheme(layer) == f"gguf {qtype.name}"
    reference = torch.cat([s.dequantize() for s in shards])
    torch.testing.assert_close(layer.qpanels.dequantize(), reference, atol=1e-6, rtol=0)  # exact blocks
    x = torch.randn(7, 96)
    # 4-bit layers quantize x to two int8 terms per group (~16-bit precise): docs/quantization.md
    torch.testing.assert_close(layer(x), F.linear(x, reference), atol=5e-3, rtol=1e-3)


def test_mixed_shard_types_fall_back_to_int8_groups() -> None:
    layer = Linear(64, 48, bias=True, dtype=torch.float32, quant_config=GGUFConfig(), shard_sizes=(32, 16))
    a, b = _quant(32, 64, GGMLQuantizationType.Q4_1, 4), _quant(16, 64, GGMLQuantizationType.Q8_0, 5)
    layer.weight.weight_loader(layer.weight, a, 0)
    layer.weight.weight_loader(layer.weight, b, 1)
    layer.bias.weight_loader(layer.bias, torch.ones(32), 0)
    layer.bias.weight_loader(layer.bias, torch.zeros(16), 1)
    layer.process_weights_after_loading()
    assert "int8 g32" in layer.quant_method.scheme(layer)
    reference = torch.cat([a.dequantize(), b.dequantize()])
    # Q8_0 blocks re-quantize exactly; Q4_1 values within half an int8 step of their group.
    assert (layer.qpanels.dequantize() - reference).abs().max() < reference.abs().max() / 127
    x = torch.randn(3, 64)
    expected = F.linear(x, layer.qpanels.dequantize()) + torch.cat([torch.ones(32), torch.zeros(16)])
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)


def test_missing_shard_is_an_error() -> None:
    layer = Linear(64, 48, bias=False, dtype=torch.float32, quant_config=GGUFConfig(), shard_sizes=(32, 16),
                   prefix="mlp.gate_up_proj")
    layer.weight.weight_loader(layer.weight, _quant(32, 64, GGMLQuantizationType.Q4_0), 0)
    with pytest.raises(ValueError, match="not every shard"):
        layer.process_weights_after_loading()
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, _quant(32, 64, GGMLQuantizationType.Q4_0), 1)


def _random_k_quant(rows: int, k: int, qtype: GGMLQuantizationType, seed: int) -> GGUFQuantTensor:
    """Random K-quant super-blocks (every bit pattern is a valid encoding) with sane f16 scales."""
    block_bytes = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q6_K: 210}[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, k // 256, block_bytes), dtype=np.uint8)
    f16_at = (0, 2) if qtype == GGMLQuantizationType.Q4_K else (208,)
    for at in f16_at:
        scale = rng.uniform(1e-3, 2e-2, size=(rows, k // 256)).astype(np.float16)
        blocks[..., at:at + 2] = scale[..., None].view(np.uint8).reshape(rows, k // 256, 2)
    raw = torch.from_numpy(blocks.reshape(rows, -1))
    return GGUFQuantTensor(raw, int(qtype), (rows, k))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K], ids=lambda t: t.name)
def test_k_quants_match_gguf_dequantize(qtype: GGMLQuantizationType) -> None:
    shards = [_random_k_quant(24, 512, qtype, 1), _random_k_quant(40, 512, qtype, 2)]
    layer = Linear(512, 64, bias=False, dtype=torch.float32, quant_config=GGUFConfig(), shard_sizes=(24, 40))
    for i, s in enumerate(shards):
        layer.weight.weight_loader(layer.weight, s, i)
    layer.process_weights_after_loading()
    assert layer.quant_method.scheme(layer) == f"gguf {qtype.name}"
    assert layer.qpanels.is_q4 == (qtype == GGMLQuantizationType.Q4_K)
    reference = torch.cat([s.dequantize() for s in shards])
    # Q4_K's scales (fp16 d x 6-bit sub-scale) are rounded to float16 in the dot8 layout: ~2^-12 of a group's range
    atol = 1e-6 if qtype != GGMLQuantizationType.Q4_K else 2e-3 * reference.abs().max().item()
    torch.testing.assert_close(layer.qpanels.dequantize(), reference, atol=atol, rtol=1e-6)
    torch.manual_seed(0)
    x = torch.randn(3, 512)
    expected = F.linear(x, layer.qpanels.dequantize())  # random super-blocks: outputs in the hundreds
    # 4-bit layers quantize x to two int8 terms per group (~16-bit precise): docs/quantization.md
    torch.testing.assert_close(layer(x), expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-3)


def test_q8_0_fused_with_q6_k_shares_groups_of_16() -> None:
    a = _quant(32, 256, GGMLQuantizationType.Q8_0, 6)
    b = _random_k_quant(16, 256, GGMLQuantizationType.Q6_K, 7)
    layer = Linear(256, 48, bias=False, dtype=torch.float32, quant_config=GGUFConfig(), shard_sizes=(32, 16))
    layer.weight.weight_loader(layer.weight, a, 0)
    layer.weight.weight_loader(layer.weight, b, 1)
    layer.process_weights_after_loading()
    assert layer.qpanels.group == 16 and "int8" not in layer.quant_method.scheme(layer)
    torch.testing.assert_close(layer.qpanels.dequantize(), torch.cat([a.dequantize(), b.dequantize()]),
                               atol=1e-6, rtol=1e-6)


def test_float_matrices_stay_float() -> None:
    """An F32 (or F16/BF16) matrix in a GGUF file is kept as stored, not re-quantized, under gguf."""
    torch.manual_seed(9)
    shards = [torch.randn(24, 64), torch.randn(8, 64)]
    layer = Linear(64, 32, bias=False, dtype=torch.float32, quant_config=GGUFConfig(), shard_sizes=(24, 8))
    for i, s in enumerate(shards):
        layer.weight.weight_loader(layer.weight, s, i)
    layer.process_weights_after_loading()
    layer.process_weights_after_loading()  # idempotent
    assert layer.qpanels is None and "float" in layer.quant_method.scheme(layer)
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat(shards)), atol=1e-5, rtol=1e-5)
