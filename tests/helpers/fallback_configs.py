"""Tiny configs of architectures pagedllm has no native code for (they run through the transformers fallback),
chosen for what each does differently, and a helper to save one as an HF folder the engine loads."""

from __future__ import annotations

import os
from typing import Any

from helpers.arch_configs import VOCAB, WINDOW, hf_model, save_word_tokenizer

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_GPT_STYLE = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2)

# architecture -> what it exercises in the fallback
FALLBACK_ARCHS = {
    "Olmo2ForCausalLM": "q/k RMSNorm over all heads, post-norms",
    "PhiForCausalLM": "partial rotary, parallel attention and MLP, LayerNorm with bias",
    "GPTNeoXForCausalLM": "parallel residual, partial rotary, fused qkv",
    "Gemma2ForCausalLM": "final logit soft-capping, alternating sliding-window layers, query_pre_attn_scalar",
    "GraniteForCausalLM": "embedding / residual / attention multipliers, logits scaling",
    "CohereForCausalLM": "logit scale, interleaved rotary, parallel block",
    "Starcoder2ForCausalLM": "sliding window on every layer, biases, GELU MLP",
    "SmolLM3ForCausalLM": "NoPE layers (no rotary on every 4th layer)",
    "GPTJForCausalLM": "rotary on the first rotary_dim dims, interleaved, LM head bias",
    "GPTBigCodeForCausalLM": "multi-query attention, learned positions",
    "OPTForCausalLM": "learned positions with an offset, ReLU MLP",
    "Glm4ForCausalLM": "partial rotary, sandwich norms, fused gate/up",
}


def fallback_config(arch: str) -> Any:
    import transformers as tf

    if arch == "Olmo2ForCausalLM":
        return tf.Olmo2Config(**_COMMON, architectures=[arch])
    if arch == "PhiForCausalLM":
        return tf.PhiConfig(**_COMMON, partial_rotary_factor=0.5, architectures=[arch])
    if arch == "GPTNeoXForCausalLM":
        return tf.GPTNeoXConfig(**{k: v for k, v in _COMMON.items() if k != "num_key_value_heads"},
                                rotary_pct=0.5, use_parallel_residual=True, architectures=[arch])
    if arch == "Gemma2ForCausalLM":
        return tf.Gemma2Config(**_COMMON, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                               final_logit_softcapping=5.0, attn_logit_softcapping=None, architectures=[arch])
    if arch == "GraniteForCausalLM":
        return tf.GraniteConfig(**_COMMON, embedding_multiplier=2.0, residual_multiplier=0.5,
                                attention_multiplier=0.2, logits_scaling=4.0, architectures=[arch])
    if arch == "CohereForCausalLM":
        return tf.CohereConfig(**_COMMON, logit_scale=0.5, architectures=[arch])
    if arch == "Starcoder2ForCausalLM":
        return tf.Starcoder2Config(**_COMMON, sliding_window=WINDOW, use_bias=True, architectures=[arch])
    if arch == "SmolLM3ForCausalLM":
        return tf.SmolLM3Config(**{**_COMMON, "num_hidden_layers": 4}, no_rope_layer_interval=4,
                                architectures=[arch])
    if arch == "GPTJForCausalLM":
        return tf.GPTJConfig(**_GPT_STYLE, rotary_dim=8, tie_word_embeddings=False, architectures=[arch])
    if arch == "GPTBigCodeForCausalLM":
        return tf.GPTBigCodeConfig(**_GPT_STYLE, multi_query=True, architectures=[arch])
    if arch == "OPTForCausalLM":
        return tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                            word_embed_proj_dim=64, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0, architectures=[arch])
    if arch == "Glm4ForCausalLM":
        return tf.Glm4Config(**_COMMON, head_dim=16, partial_rotary_factor=0.5, architectures=[arch])
    raise KeyError(arch)


def save_fallback_tiny(arch: str, path: str | os.PathLike, seed: int = 0) -> tuple[str, Any]:
    """Save a tiny random ``arch`` model (safetensors, config, word tokenizer); returns (path, HF model)."""
    model = hf_model(fallback_config(arch), seed)
    model.save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path), model
