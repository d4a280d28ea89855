"""dots.llm1 (``Dots1ForCausalLM``, rednote-hilab): Qwen3's attention (per-head q/k RMSNorm; bias on all four
projections with ``attention_bias``; sliding-window layers from ``layer_types``) over DeepSeek-V3's mixture of
experts (``deepseek.py``: sigmoid routing with a score correction bias and groups, ungated shared experts, dense
layers before ``first_k_dense_replace``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.models.deepseek import dense_or_moe, sigmoid_routing_rule
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.weight_loading import STACKED_EXPERTS, STACKED_QKV_GATE_UP, WeightMapping


class Dots1ForCausalLM(LlamaForCausalLM):
    """dots.llm1 (module docstring)."""

    qkv_bias, o_proj_bias = None, None  # both the config's attention_bias
    qk_norm = True
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, experts=STACKED_EXPERTS, skip=("rotary_emb.inv_freq",))

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        return dense_or_moe(cfg, layer_idx, dtype, quant_config, prefix,
                            lambda: (sigmoid_routing_rule(cfg, cls.__name__), True))
