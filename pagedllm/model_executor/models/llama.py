"""Pre-norm decoders of the Llama shape: Llama 2/3, SmolLM2, Mistral (sliding window), Qwen2/2.5 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm), Phi-3 (q/k/v and gate/up already fused in the checkpoint).

    x -> embed -> [ RMSNorm -> attention (rotary) -> + -> RMSNorm -> gated MLP -> + ] x N -> RMSNorm -> head

The model sees one flat batch per step: ``input_ids[T]`` and ``positions[T]``, no batch dim and no
padding. Attention reads its per-step metadata from the forward context and its K/V from the paged cache.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

import torch
from torch import nn

from pagedllm.attention.spec import AttentionSpec, layer_attention_specs
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.layernorm import RMSNorm
from pagedllm.model_executor.layers.parallel_linear import make_embedding
from pagedllm.model_executor.layers.rotary_embedding import (
    RopeStep,
    RotaryEmbedding,
    partial_rotary_factor,
    rope_settings,
)
from pagedllm.model_executor.models.base import CausalLM
from pagedllm.model_executor.models.blocks import GatedMLP, RotaryAttention, head_dim_of
from pagedllm.model_executor.models.weight_loading import STACKED_QKV_GATE_UP, WeightMapping


class LlamaDecoderLayer(DirectCall, nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, spec: AttentionSpec, arch: type[LlamaForCausalLM],
                 dtype: torch.dtype, quant_config: Any = None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = arch.make_attention(cfg, layer_idx, spec, dtype, quant_config, f"{prefix}.self_attn")
        self.mlp = arch.make_mlp(cfg, layer_idx, dtype, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: RopeStep) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, hidden]; returns this layer's output and the residual stream (not yet summed)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(DirectCall, nn.Module):
    def __init__(self, cfg: Any, arch: type[LlamaForCausalLM], dtype: torch.dtype, quant_config: Any = None) -> None:
        super().__init__()
        rotary_dim = head_dim_of(cfg)
        if partial_rotary_factor(cfg) != 1.0:
            if not arch.partial_rotary:
                raise ValueError(f"{arch.__name__}: partial_rotary_factor != 1 is not supported")
            rotary_dim = int(head_dim_of(cfg) * partial_rotary_factor(cfg))
        specs = layer_attention_specs(cfg)
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.embedding_scale = arch.embedding_scale(cfg)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, specs[i], arch, dtype, quant_config)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        theta, scaling = rope_settings(cfg)
        self.rotary_emb = RotaryEmbedding(head_dim_of(cfg), cfg.max_position_embeddings, theta, scaling, dtype,
                                          rotary_dim=rotary_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden] after the final norm. ``num_layers``: run only the
        first that many decoder layers (layer-skip drafting, ``spec_decode/model_drafter.py``); None: all.
        ``inputs_embeds`` [T, hidden]: the step's input embeddings instead of ``input_ids``'s (a VLM's, with image
        rows merged in)."""
        if inputs_embeds is None:
            x = self.embed_tokens(input_ids)
            x = x * self.embedding_scale if self.embedding_scale is not None else x
        else:
            x = inputs_embeds
        rope = self.rope_step(positions)  # once per step, shared by all layers
        residual = None
        for layer in self.layers if num_layers is None else islice(self.layers, num_layers):
            x, residual = layer(x, residual, rope)
        x, _ = self.norm(x, residual)
        return x

    def rope_step(self, positions: torch.Tensor) -> RopeStep:
        """The step's rotary inputs for ``positions`` [T] (M-RoPE models take [3, T]: ``models/mrope.py``)."""
        return RopeStep(self.rotary_emb, positions)


class LlamaForCausalLM(CausalLM):
    """Causal LM head over ``LlamaModel``; parameter names mirror HF's except the fused projections.

    Subclasses change only what their architecture changes (class attributes below).
    """

    qkv_bias: bool | None = None  # None: the config's attention_bias
    o_proj_bias: bool | None = None
    qk_norm: bool | None = False  # None: the config's use_qk_norm
    qk_norm_per_head = True  # False: q/k norms over the whole projection (OLMoE)
    attention_sinks = False  # a learned per-head logit in each softmax's denominator (gpt-oss)
    # Only part of each head rotates (``partial_rotary_factor``); the family reorders its q/k rows at load
    # (``weight_loading.partial_rotary_checkpoint``).
    partial_rotary = False
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, skip=("rotary_emb.inv_freq",))

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, quant_config: Any = None) -> None:
        super().__init__()
        self.model = LlamaModel(hf_config, type(self), dtype, quant_config)
        self._init_head(hf_config, dtype, quant_config)

    @classmethod
    def attention_scale(cls, cfg: Any) -> float | None:
        """The softmax scale of attention scores; None: 1/sqrt(head_dim)."""
        return None

    @classmethod
    def embedding_scale(cls, cfg: Any) -> float | None:
        """A factor on the token embeddings (inside the decoder stack, so layer-skip drafts get it too); None:
        none."""
        return None

    @classmethod
    def make_attention(cls, cfg: Any, layer_idx: int, spec: AttentionSpec, dtype: torch.dtype, quant_config: Any,
                       prefix: str) -> nn.Module:
        """Layer ``layer_idx``'s attention ``(x [T, hidden], rope) -> [T, hidden]``: fused q/k/v with rotary (DeepSeek
        returns its latent attention, ``models/deepseek.py``)."""
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        eps = cfg.rms_norm_eps
        qk_norm = cls.qk_norm if cls.qk_norm is not None else bool(getattr(cfg, "use_qk_norm", False))
        return RotaryAttention(
            cfg.hidden_size, cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
            or cfg.num_attention_heads, head_dim_of(cfg), layer_idx=layer_idx, dtype=dtype, spec=spec,
            qkv_bias=attention_bias if cls.qkv_bias is None else cls.qkv_bias,
            o_bias=attention_bias if cls.o_proj_bias is None else cls.o_proj_bias,
            qk_norm=(lambda d: RMSNorm(d, eps, dtype)) if qk_norm else None,
            quant_config=quant_config, prefix=prefix, sinks=cls.attention_sinks,
            scale=cls.attention_scale(cfg), qk_norm_per_head=cls.qk_norm_per_head,
            clip_qkv=getattr(cfg, "clip_qkv", None))

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block ``[T, hidden] -> [T, hidden]``: a gated MLP (MoE families
        return their expert block, ``models/moe.py``)."""
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"),
                        bias=bool(getattr(cfg, "mlp_bias", False)), dtype=dtype, quant_config=quant_config,
                        prefix=prefix)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: bias on q, k and v, none on the output projection."""

    qkv_bias, o_proj_bias = True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: RMSNorm over each head of q and k before rotary."""

    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: the checkpoint already stores ``qkv_proj`` and ``gate_up_proj`` fused, rows [q|k|v], [gate|up]."""

    # Stacked names too: kept-quantized GGUF blocks of the fused matrices arrive one shard at a time.
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, skip=("rotary_emb.inv_freq",))
