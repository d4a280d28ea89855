"""Tiny random mixture-of-experts configs (transformers' own config classes) and HF folders of them."""

from __future__ import annotations

import os
from typing import Any

from helpers.arch_configs import VOCAB, hf_model, save_word_tokenizer

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               tie_word_embeddings=False)

# name -> (architecture, config overrides): 4-16 experts, top-1 to top-4, with and without renormalisation, a
# shared expert, a dense layer among the sparse ones.
MOE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-e4-top2": ("MixtralForCausalLM", dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2moe-e8-top4-shared": ("Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=8, num_experts_per_tok=4, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3moe-e16-top1-norm": ("Qwen3MoeForCausalLM", dict(
        head_dim=32, intermediate_size=128, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=1,
        norm_topk_prob=True)),
    "qwen3moe-e8-top3": ("Qwen3MoeForCausalLM", dict(
        head_dim=16, intermediate_size=128, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=False)),
}


def moe_config(variant: str) -> Any:
    import transformers as tf

    arch, overrides = MOE_VARIANTS[variant]
    cls = {"MixtralForCausalLM": tf.MixtralConfig, "Qwen2MoeForCausalLM": tf.Qwen2MoeConfig,
           "Qwen3MoeForCausalLM": tf.Qwen3MoeConfig}[arch]
    return cls(**{**_COMMON, **overrides}, architectures=[arch])


def save_tiny_moe(variant: str, path: str | os.PathLike, seed: int = 0) -> tuple[str, Any]:
    """Save a tiny random MoE of ``variant`` (safetensors with per-expert tensors + config + tokenizer);
    returns (path, the transformers model)."""
    model = hf_model(moe_config(variant), seed)
    model.save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path), model


def gpt_oss_config(**overrides: Any) -> Any:
    """A tiny gpt-oss: 3 layers (sliding, full, sliding; window 8), 8 experts top-2, a low SwiGLU limit (so the
    clamps bite on random weights), default yarn rope."""
    import transformers as tf

    settings = dict(_COMMON, num_hidden_layers=3, head_dim=16, intermediate_size=32, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.5)
    return tf.GptOssConfig(**{**settings, **overrides}, architectures=["GptOssForCausalLM"])


def save_tiny_gpt_oss(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> tuple[str, Any]:
    """Save a tiny random gpt-oss (its own fused, interleaved expert tensors) + tokenizer; sinks drawn wide (std 1)
    so that they change the softmax visibly. Returns (path, the transformers model)."""
    import torch

    model = hf_model(gpt_oss_config(**overrides), seed)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape,
                                                    generator=torch.Generator().manual_seed(seed + i)))
    model.save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path), model


def olmoe_config(**overrides: Any) -> Any:
    """A tiny OLMoE: 8 experts top-2 renormalised, q/k norms over all heads, clip_qkv low enough to bite."""
    import transformers as tf

    settings = dict(_COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                    clip_qkv=0.8)
    return tf.OlmoeConfig(**{**settings, **overrides}, architectures=["OlmoeForCausalLM"])


def granite_moe_config(**overrides: Any) -> Any:
    """A tiny Granite-MoE: 4 experts top-2 (top-k then softmax) and every multiplier away from 1."""
    import transformers as tf

    settings = dict(_COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.5)
    return tf.GraniteMoeConfig(**{**settings, **overrides}, architectures=["GraniteMoeForCausalLM"])


def save_tiny(config: Any, path: str | os.PathLike, seed: int = 0) -> tuple[str, Any]:
    """Save a tiny random model of ``config`` + tokenizer; returns (path, the transformers model)."""
    model = hf_model(config, seed)
    model.save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path), model


def bf16_experts_form() -> str:
    """How ``FusedMoE.describe()`` ends for bf16 experts on this CPU: stacked bf16 panels where it has AVX-512 BF16
    (``moe_bf16_gemm``), else the dense layers' bf16 form per expert."""
    from pagedllm.kernels.cpu import load_cpu_kernels

    kernels = load_cpu_kernels()
    stacked = kernels is not None and hasattr(kernels, "moe_bf16_gemm") and kernels.bf16_gemm_supported()
    return "stacked (moe_bf16_gemm)" if stacked else "per expert"


# DeepSeek-V2 / V3: latent attention (latent 24 + rotary 8), 8 experts top-3, one shared, a dense first layer.
_DEEPSEEK_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=24,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

DEEPSEEK_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # V2-Lite's shape: no q compression, greedy softmax routing.
    "v2-lite": ("DeepseekV2Config", dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)),
    # V2's: q through its own latent, group-limited routing, a scaling factor, YaRN with mscale_all_dim.
    "v2-grouped-yarn": ("DeepseekV2Config", dict(
        q_lora_rank=20, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1})),
    # V3's: sigmoid scores with a correction bias, groups, renormalised and scaled; interleaved rotary pairs.
    "v3": ("DeepseekV3Config", dict(q_lora_rank=20, n_group=2, topk_group=1, norm_topk_prob=True,
                                    routed_scaling_factor=2.5, rope_interleave=True)),
    "v3-rotate-half": ("DeepseekV3Config", dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                                                routed_scaling_factor=1.0, rope_interleave=False)),
    # V3 with every projection a multiple of 16 (the fp8 checkpoint test's 16 x 16 blocks); a 48-wide latent head.
    "v3-fp8-dims": ("DeepseekV3Config", dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, n_group=2,
                                             topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)),
    # GLM-4.7-Flash: V3's architecture, dense / sparse layers listed (the last dense: not first_k_dense_replace's).
    "glm-4.7-flash": ("Glm4MoeLiteConfig", dict(
        q_lora_rank=20, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
        mlp_layer_types=["dense", "sparse", "dense"])),
}


def save_tiny_deepseek(variant: str, path: str | os.PathLike, seed: int = 0) -> tuple[str, Any]:
    """Save a tiny random DeepSeek of ``variant`` (``DEEPSEEK_VARIANTS``) with a correction bias that changes the
    routing + tokenizer; returns (path, the transformers model)."""
    import torch
    import transformers as tf

    cls_name, overrides = DEEPSEEK_VARIANTS[variant]
    cfg = getattr(tf, cls_name)(**{**_DEEPSEEK_COMMON, **overrides})
    model = hf_model(cfg, seed)
    with torch.no_grad():  # a correction bias that changes choices (transformers initialises it to zeros)
        g = torch.Generator().manual_seed(seed + 7)
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.rand(bias.shape, generator=g) * 0.5)
    model.save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path), model


# GLM-4.5 (Glm4Moe): half of each head rotates, q/k/v bias, DeepSeek-V3's router; with and without q/k norms.
GLM4_MOE_VARIANTS: dict[str, dict[str, Any]] = {
    "qk-norm-grouped": dict(use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    "plain": dict(use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False),
}


def save_tiny_glm4_moe(variant: str, path: str | os.PathLike, seed: int = 0) -> tuple[str, Any]:
    """Save a tiny random GLM-4.5 MoE of ``variant`` (head 16, 8 of its dims rotary) with a correction bias that
    changes the routing + tokenizer; returns (path, the transformers model)."""
    import torch
    import transformers as tf

    cfg = tf.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, first_k_dense_replace=1, attention_bias=True, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, **GLM4_MOE_VARIANTS[variant])
    model = hf_model(cfg, seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 7)
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(cfg.n_routed_experts, generator=g) * 0.5)
            for name in ("q_proj", "k_proj", "v_proj"):  # biases drawn wide: the reordered rows must carry them
                bias = getattr(layer.self_attn, name).bias
                bias.copy_(torch.randn(bias.shape, generator=g))
    model.save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path), model


def save_tiny_minimax_m2(path: str | os.PathLike, seed: int = 0) -> tuple[str, Any]:
    """Save a tiny random MiniMax-M2 (head 16 with 8 rotary dims, q/k norms over all heads, 8 experts top-2) with a
    correction bias that changes the routing + tokenizer; returns (path, the transformers model)."""
    import torch
    import transformers as tf

    cfg = tf.MiniMaxM2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rotary_dim=8, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = hf_model(cfg, seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 7)
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.copy_(torch.rand(cfg.num_local_experts, generator=g) * 0.5)
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):  # weights that differ per dim
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=g))
    model.save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path), model


def save_tiny_dots1(path: str | os.PathLike, seed: int = 0) -> tuple[str, Any]:
    """Save a tiny random dots.llm1 (per-head q/k norms, a sliding layer, DeepSeek-V3's router with 2 groups, one
    shared expert, a dense first layer) + tokenizer; returns (path, the transformers model)."""
    import torch
    import transformers as tf

    cfg = tf.Dots1Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.0, sliding_window=16,
        layer_types=["full_attention", "sliding_attention", "full_attention"], max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = hf_model(cfg, seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 7)
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(cfg.n_routed_experts, generator=g) * 0.5)
    model.save_pretrained(str(path))
    save_word_tokenizer(path)
    return str(path), model
