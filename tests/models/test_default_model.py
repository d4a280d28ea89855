"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF): our loader + model vs transformers' GGUF path."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.model_executor.loader import load_model, load_tokenizer, resolve_model_config

from helpers.model_helpers import prefill_logits

# Both sides dequantize the same Q4_1/Q8_0 blocks to fp32 (--quantization none; the kept-quantized default
# is compared with this path in tests/quantization/test_gguf_default.py); differences come only from op order.
ATOL = 2e-3


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_path: str, monkeypatch) -> None:
    mc = resolve_model_config(ModelConfig(model="SmolLM2-135M-Instruct", dtype="float32", quantization="none"))
    assert mc.gguf_file == default_model_path and mc.architecture == "LlamaForCausalLM"
    assert mc.eos_token_ids == [2] and mc.vocab_size == 49152 and mc.max_model_len == 8192
    cfg = mc.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_parameters["rope_theta"] == 100000.0 and cfg.tie_word_embeddings
    tok = load_tokenizer(mc)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == 1 and tok.eos_token_id == 2  # ChatML from the GGUF metadata, no BOS added

    model = load_model(mc, torch.device("cpu"))
    ours = prefill_logits(model, ids)

    import gguf
    from transformers import AutoModelForCausalLM

    # Speed-ups for the reference only (35 s -> 9 s): transformers rebuilds gguf's tensor-name map once per
    # tensor, and parsing the config via GGUFReader takes ~12 s, so we hand it our (asserted) config.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_model_path),
                                              gguf_file=os.path.basename(default_model_path),
                                              config=copy.deepcopy(mc.hf_config),
                                              dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
