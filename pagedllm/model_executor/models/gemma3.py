"""Gemma 3 (text): local sliding-window and global layers (5 : 1), four (1 + w) RMSNorms per layer.

    x -> embed * sqrt(hidden) -> [ norm -> attention (q/k norm, rotary) -> norm -> +
                                   -> norm -> GeGLU MLP -> norm -> + ] x N -> norm -> head (softcap)

Local layers rotate with ``rope_local_base_freq`` (10k), global ones with ``rope_theta`` (1M, maybe
scaled); attention scale is ``query_pre_attn_scalar ** -0.5``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.spec import AttentionSpec, layer_attention_specs
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.layernorm import GemmaRMSNorm
from pagedllm.model_executor.layers.parallel_linear import make_embedding
from pagedllm.model_executor.layers.rotary_embedding import RopeStep, RotaryEmbedding
from pagedllm.model_executor.models.base import CausalLM
from pagedllm.model_executor.models.blocks import GatedMLP, RotaryAttention, head_dim_of
from pagedllm.model_executor.models.weight_loading import STACKED_QKV_GATE_UP, WeightMapping


def _rope_params(cfg: Any, layer_type: str) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) of one layer type; transformers 5 nests them per type in ``rope_parameters``."""
    params = dict((getattr(cfg, "rope_parameters", None) or {}).get(layer_type) or {})
    if layer_type == "sliding_attention":
        default = getattr(cfg, "rope_local_base_freq", None) or 10000.0
    else:
        default = getattr(cfg, "rope_theta", None) or 1_000_000.0
    return float(params.get("rope_theta", default)), params


class Gemma3DecoderLayer(DirectCall, nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, spec: AttentionSpec, dtype: torch.dtype,
                 quant_config: Any = None) -> None:
        super().__init__()
        if getattr(cfg, "attn_logit_softcapping", None):
            raise ValueError("Gemma 3: attn_logit_softcapping is not supported")
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        prefix = f"model.layers.{layer_idx}"
        self.is_sliding = spec.kind == "sliding"
        self.self_attn = RotaryAttention(
            hidden, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim_of(cfg), layer_idx=layer_idx,
            dtype=dtype, spec=spec, scale=float(cfg.query_pre_attn_scalar) ** -0.5,
            qkv_bias=bool(getattr(cfg, "attention_bias", False)), o_bias=bool(getattr(cfg, "attention_bias", False)),
            qk_norm=lambda d: GemmaRMSNorm(d, eps, dtype), quant_config=quant_config, prefix=f"{prefix}.self_attn")
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, act, dtype=dtype, quant_config=quant_config,
                            prefix=f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope_local: RopeStep,
                rope_global: RopeStep) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, hidden]; returns this layer's output and the residual stream (not yet summed)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, rope_local if self.is_sliding else rope_global))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, quant_config: Any = None) -> None:
        super().__init__()
        specs = layer_attention_specs(cfg)
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, specs[i], dtype, quant_config)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        head_dim, max_pos = head_dim_of(cfg), cfg.max_position_embeddings
        self.rotary_local = RotaryEmbedding(head_dim, max_pos, *_rope_params(cfg, "sliding_attention"), dtype)
        self.rotary_global = RotaryEmbedding(head_dim, max_pos, *_rope_params(cfg, "full_attention"), dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> scaled token embeddings [T, hidden] (the scale rounded to the model dtype first, as the
        reference does)."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; inputs_embeds: [T, hidden], already scaled (``embed``, image rows merged
        unscaled as Gemma 3's multimodal model merges them), or None -> hidden [T, hidden]."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope_local, rope_global = RopeStep(self.rotary_local, positions), RopeStep(self.rotary_global, positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope_local, rope_global)
        x, _ = self.norm(x, residual)
        return x


class Gemma3ForCausalLM(CausalLM):
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, skip=("rotary_emb.inv_freq",))

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, quant_config: Any = None) -> None:
        super().__init__()
        self.model = Gemma3Model(hf_config, dtype, quant_config)
        self._init_head(hf_config, dtype, quant_config)
