"""Where a PEFT module lands in pagedllm's layers.

PEFT names modules as the transformers model does (``model.layers.0.self_attn.q_proj``); pagedllm fuses q/k/v into
``qkv_proj`` (rows [q | k | v]) and gate/up into ``gate_up_proj`` (rows [gate | up]). An adapter on ``q_proj`` only
therefore adds to the q rows of the fused output and nothing to k or v. A checkpoint that stores the fused matrix
itself (Phi-3) targets the fused layer whole.
"""

from __future__ import annotations

from typing import Any

# PEFT module name -> (pagedllm's fused layer name, shard index in it).
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# The decoder families whose layers these names describe (models/llama.py and its subclasses).
LORA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# Mixtures of experts on Llama's attention: adapters on the attention projections (q, k, v, o) only; the experts
# carry none. (GLM-4.5 and MiniMax-M2 reorder their q/k rows at load, Granite-MoE folds a multiplier into o_proj,
# DeepSeek's latent attention has other projections: not these.)
LORA_ATTENTION_ONLY_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "dots1")


def layer_target(module: str) -> tuple[str, int | None]:
    """(pagedllm layer path, shard index or None for the whole layer) of PEFT module path ``module``."""
    parent, _, leaf = module.rpartition(".")
    if leaf in FUSED_SHARDS:
        fused, shard = FUSED_SHARDS[leaf]
        return f"{parent}.{fused}", shard
    return module, None


def base_module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every module of the base model that LoRA may target, by PEFT module path.

    ValueError when the architecture is not one whose layers pagedllm can give adapters.
    """
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in LORA_MODEL_TYPES + LORA_ATTENTION_ONLY_MODEL_TYPES:
        raise ValueError(f"enable_lora: model type {model_type!r} cannot carry LoRA adapters in pagedllm; "
                         f"supported: {', '.join(LORA_MODEL_TYPES)} and, on the attention projections only, "
                         f"{', '.join(LORA_ATTENTION_ONLY_MODEL_TYPES)}")
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = {
        "self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
    }
    if model_type in LORA_MODEL_TYPES:
        per_layer.update({"mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                          "mlp.down_proj": (hidden, inter)})
    if model_type == "phi3":  # its checkpoints (and so its adapters) hold the fused matrices
        per_layer = {"self_attn.qkv_proj": (q + 2 * kv, hidden), "self_attn.o_proj": (hidden, q),
                     "mlp.gate_up_proj": (2 * inter, hidden), "mlp.down_proj": (hidden, inter)}
    return {f"model.layers.{i}.{name}": shape
            for i in range(hf_config.num_hidden_layers) for name, shape in per_layer.items()}
