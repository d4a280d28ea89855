"""fp8 weights: ``--quantization fp8`` (per-channel e4m3 from float weights at load) and checkpoints whose
config.json says ``quant_method: fp8`` (float8_e4m3fn weights with per-tensor, per-channel or block scales),
written here with safetensors from a tiny random Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.quantization import get_quantization_config
from pagedllm.model_executor.layers.quantization.fp8 import Fp8Config
from pagedllm.model_executor.loader.model_config import resolve_model_config
from pagedllm.model_executor.loader.model_loader import load_model, weight_bytes_by_scheme

from helpers.fp8_checkpoints import fp8_checkpoint
from helpers.model_helpers import make_tiny_llama, prefill_logits

IDS = [1, 17, 93, 5, 200, 41, 77, 3, 150, 9, 64]


def test_fused_fp8_layer_matches_its_dequantized_weight() -> None:
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True, quant_config=Fp8Config(), shard_sizes=(32, 16), prefix="x.qkv_proj")
    w0, w1 = torch.randn(32, 64), torch.randn(16, 64) * 5
    layer.weight.weight_loader(layer.weight, w0, 0)
    layer.weight.weight_loader(layer.weight, w1, 1)
    layer.bias.weight_loader(layer.bias, torch.randn(48), None)
    layer.process_weights_after_loading()
    assert layer.weight is None and layer.quant_method.scheme(layer) == "fp8 per-channel"
    w = layer.qpanels.dequantize()
    # Per-channel scales: each row's largest magnitude is exactly 448 * scale.
    torch.testing.assert_close(w.abs().amax(1), torch.cat([w0, w1]).abs().amax(1), rtol=1e-6, atol=0)
    assert (w - torch.cat([w0, w1])).abs().max() <= torch.cat([w0, w1]).abs().max() / 16
    for rows in (1, 5, 9, 33):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, w, layer.bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_checkpoint_matches_its_dequantized_float_model(tmp_path: Path, scheme: str) -> None:
    src = Path(make_tiny_llama(tmp_path / "float", seed=5))
    dequantized = fp8_checkpoint(src, tmp_path / "fp8", scheme)
    float_dir = tmp_path / "dequantized"
    float_dir.mkdir()
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(float_dir / "model.safetensors"))
    (float_dir / "config.json").write_text((src / "config.json").read_text())

    mc = resolve_model_config(ModelConfig(model=str(tmp_path / "fp8")))
    assert mc.dtype == "float32"
    model = load_model(mc)
    schemes = weight_bytes_by_scheme(model)
    expected = "fp8 block 16x16" if scheme == "block" else "fp8 per-channel"
    assert schemes[expected][0] == 8  # qkv, o, gate_up, down in 2 layers; the tied head stays float
    ref_model = load_model(resolve_model_config(ModelConfig(model=str(float_dir), dtype="float32")))
    ours, ref = prefill_logits(model, IDS), prefill_logits(ref_model, IDS)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_fp8_checkpoint_logits_close_to_transformers(tmp_path: Path) -> None:
    """transformers reads the block-scaled (fine-grained) fp8 checkpoint too; on a CPU it dequantizes it."""
    from transformers import AutoModelForCausalLM

    src = Path(make_tiny_llama(tmp_path / "float", seed=6))
    fp8_checkpoint(src, tmp_path / "fp8", "block")
    ours = prefill_logits(load_model(resolve_model_config(ModelConfig(model=str(tmp_path / "fp8")))), IDS)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    # transformers dequantizes to bf16 on a CPU: bf16 rounding of weights and activations.
    assert (ours - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


def test_dynamic_fp8_from_a_float_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_llama(tmp_path / "float", seed=7)
    mc = resolve_model_config(ModelConfig(model=path, quantization="fp8"))
    model = load_model(mc)
    schemes = weight_bytes_by_scheme(model)
    assert schemes["fp8 per-channel"][0] == 8 and schemes["int8 per-channel"][0] == 1  # the tied head: int8
    ref = prefill_logits(load_model(resolve_model_config(ModelConfig(model=path, dtype="float32"))), IDS)
    ours = prefill_logits(model, IDS)
    # e4m3 keeps 3 mantissa bits (~2-3% error per weight); through two random layers the logits stay close.
    assert ((ours - ref).norm() / ref.norm()).item() < 0.1  # measured 0.07 with an fp8 head


def test_fp8_config_errors() -> None:
    with pytest.raises(ValueError, match="e5m2"):
        Fp8Config.from_hf({"quant_method": "fp8", "fmt": "e5m2"})
    with pytest.raises(ValueError, match="weight_block_size"):
        Fp8Config.from_hf({"quant_method": "fp8", "weight_block_size": [128]})
    with pytest.raises(ValueError, match="block size"):
        Linear(40, 32, quant_config=Fp8Config(checkpoint=True, block=(16, 16)), prefix="m.down_proj")
    layer = Linear(64, 32, quant_config=Fp8Config(), prefix="m.o_proj")
    with pytest.raises(ValueError, match="scales"):  # fp8 bytes without a checkpoint's scales
        layer.weight.weight_loader(layer.weight, torch.zeros(32, 64, dtype=torch.float8_e4m3fn))
    cfg = Fp8Config.from_hf({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj",
                                                                       "model.layers.1.self_attn.q_proj"]})
    dummy = torch.nn.Module()
    assert cfg.get_linear_method(dummy, "model.layers.0.mlp.down_proj").name == "unquantized"
    assert cfg.get_linear_method(dummy, "model.layers.1.self_attn.qkv_proj").name == "unquantized"
    assert cfg.get_linear_method(dummy, "model.layers.1.mlp.down_proj").name.startswith("fp8")
    assert cfg.get_linear_method(dummy, "lm_head").name == "unquantized"
    assert get_quantization_config("fp8").name == "fp8"
