"""Tiny random-weight configs, one per supported architecture, and helpers to save them as HF folders
(with a word-level tokenizer so the engine can load them too)."""

from __future__ import annotations

import os
from typing import Any

import torch

VOCAB = 256
WINDOW = 16  # sliding window of the tiny sliding models: prompts in the tests are longer


def tiny_config(arch: str) -> Any:
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if arch == "Qwen2ForCausalLM":
        return tf.Qwen2Config(**common, tie_word_embeddings=False, architectures=[arch])
    if arch == "Qwen3ForCausalLM":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, architectures=[arch])
    if arch == "MistralForCausalLM":
        return tf.MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False, architectures=[arch])
    if arch == "Phi3ForCausalLM":
        return tf.Phi3Config(**common, tie_word_embeddings=False, architectures=[arch])
    if arch == "Gemma3ForCausalLM":
        # 6 layers: 5 local + 1 global; attention scale from query_pre_attn_scalar != head_dim; softcapping.
        return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=16, sliding_window=WINDOW,
                                   query_pre_attn_scalar=24, final_logit_softcapping=5.0,
                                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 1e4}},
                                   architectures=[arch])
    if arch == "GPT2LMHeadModel":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                             eos_token_id=2, architectures=[arch])
    if arch == "LlamaForCausalLM":
        return tf.LlamaConfig(**common, architectures=[arch])
    raise KeyError(arch)


def hf_model(config: Any, seed: int = 0) -> Any:
    """The transformers model for ``config`` with weights at std 0.08 (visible logit differences)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "norm" in name or "ln_" in name:
                p.normal_(0.0 if "gemma" in config.model_type else 1.0, 0.1)  # norms not at identity
            else:
                p.normal_(0.0, 0.05)  # biases
    return model.eval()


def save_word_tokenizer(path: str | os.PathLike, vocab_size: int = VOCAB) -> None:
    """A word-level fast tokenizer whose tokens are ``t0 .. t{vocab-1}`` (ids = numbers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(str(path))


def save_tiny(arch: str, path: str | os.PathLike, seed: int = 0) -> tuple[str, Any]:
    """Save a tiny random ``arch`` model (safetensors + config + tokenizer); returns (path, HF model)."""
    model = hf_model(tiny_config(arch), seed)
    model.save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path), model


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes (no HF cache: the plainest reference)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
