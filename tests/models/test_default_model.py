"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF): our loader + model vs transformers' GGUF path."""

from __future__ import annotations

import os

import pytest
import torch
from model_helpers import prefill_logits

from pagedllm.config import ModelConfig
from pagedllm.model_executor.loader import load_model, load_tokenizer, resolve_model_config

# Both sides dequantize the same Q4_1/Q8_0 blocks to fp32; differences come only from op order.
ATOL = 2e-3


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_path: str) -> None:
    mc = resolve_model_config(ModelConfig(model="SmolLM2-135M-Instruct", dtype="float32"))
    assert mc.gguf_file == default_model_path and mc.architecture == "LlamaForCausalLM"
    assert mc.eos_token_ids == [2] and mc.vocab_size == 49152 and mc.max_model_len == 8192
    tok = load_tokenizer(mc)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == 1 and tok.eos_token_id == 2  # ChatML from the GGUF metadata, no BOS added

    model = load_model(mc, torch.device("cpu"))
    ours = prefill_logits(model, ids)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_model_path),
                                              gguf_file=os.path.basename(default_model_path),
                                              dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
