"""GPT-2: learned absolute positions, pre-LayerNorm blocks, GELU (tanh) MLP, no rotary.

    x -> wte + wpe -> [ LN -> attention -> + -> LN -> MLP (gelu) -> + ] x N -> LN -> head (tied)

The checkpoint's Conv1D weights are stored [in, out] and its q/k/v already fused (``c_attn``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp
from pagedllm.model_executor.layers.activation import activation
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.layernorm import LayerNorm
from pagedllm.model_executor.layers.parallel_linear import (
    column_parallel_linear,
    even_part,
    make_embedding,
    row_parallel_linear,
)
from pagedllm.model_executor.models.base import CausalLM
from pagedllm.model_executor.models.blocks import RotaryAttention, make_linear
from pagedllm.model_executor.models.weight_loading import WeightMapping


class GPT2MLP(DirectCall, nn.Module):
    def __init__(self, hidden: int, inner: int, act: str, dtype: torch.dtype, quant_config: Any, prefix: str) -> None:
        super().__init__()
        if get_tp().is_parallel:  # c_fc by output rows, c_proj by input columns (+ all-reduce)
            part = even_part(inner, f"{prefix}: n_inner")
            self.c_fc = column_parallel_linear(hidden, (part,), bias=True, dtype=dtype, quant_config=quant_config,
                                               prefix=f"{prefix}.c_fc")
            self.c_proj = row_parallel_linear(part, hidden, bias=True, dtype=dtype, quant_config=quant_config,
                                              prefix=f"{prefix}.c_proj")
        else:
            self.c_fc = make_linear(hidden, inner, bias=True, dtype=dtype, quant_config=quant_config,
                                    prefix=f"{prefix}.c_fc")
            self.c_proj = make_linear(inner, hidden, bias=True, dtype=dtype, quant_config=quant_config,
                                      prefix=f"{prefix}.c_proj")
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(DirectCall, nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any = None) -> None:
        super().__init__()
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "reorder_and_upcast_attn", False):
            raise ValueError("GPT-2: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
        hidden, heads = cfg.n_embd, cfg.n_head
        prefix = f"transformer.h.{layer_idx}"
        self.ln_1 = LayerNorm(hidden, cfg.layer_norm_epsilon, dtype)
        self.attn = RotaryAttention(hidden, heads, heads, hidden // heads, layer_idx=layer_idx, dtype=dtype,
                                    qkv_bias=True, o_bias=True, quant_config=quant_config, prefix=f"{prefix}.attn")
        self.ln_2 = LayerNorm(hidden, cfg.layer_norm_epsilon, dtype)
        self.mlp = GPT2MLP(hidden, cfg.n_inner or 4 * hidden, cfg.activation_function, dtype, quant_config,
                           f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.ln_1(x)
        else:
            x, residual = self.ln_1(x, residual)
        x, residual = self.ln_2(self.attn(x, None), residual)
        return self.mlp(x), residual


class GPT2Model(DirectCall, nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, quant_config: Any = None) -> None:
        super().__init__()
        self.wte = make_embedding(cfg.vocab_size, cfg.n_embd, dtype)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd, dtype=dtype)
        self.h = nn.ModuleList(GPT2Block(cfg, i, dtype, quant_config) for i in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        residual = None
        for block in self.h:
            x, residual = block(x, residual)
        x, _ = self.ln_f(x, residual)
        return x


class GPT2LMHeadModel(CausalLM):
    embedding_name = "transformer.wte"
    weight_mapping = WeightMapping(
        renames=(("attn.c_attn.", "attn.qkv_proj."), ("attn.c_proj.", "attn.o_proj.")),
        # q/k/v apart: how kept-quantized GGUF blocks of the fused c_attn arrive
        stacked=(("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2)),
        skip=(".attn.bias", ".attn.masked_bias"),
        transposed=("qkv_proj", "o_proj", "c_fc", "c_proj"))

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, quant_config: Any = None) -> None:
        super().__init__()
        self.transformer = GPT2Model(hf_config, dtype, quant_config)
        hf_config.hidden_size = getattr(hf_config, "hidden_size", hf_config.n_embd)
        self._init_head(hf_config, dtype, quant_config)

    @property
    def model(self) -> GPT2Model:
        return self.transformer

    def load_weights(self, weights):  # GPT-2 checkpoints sometimes omit the "transformer." prefix
        def prefixed():
            for name, tensor in weights:
                yield (name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"), tensor
        return super().load_weights(prefixed())
