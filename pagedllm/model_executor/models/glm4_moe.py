"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (``Glm4MoeForCausalLM``): Llama's decoder with q/k/v bias, optional per-head
q/k RMSNorm (``use_qk_norm``), rotary on half of each head (``partial_rotary_factor``), and DeepSeek-V3's
mixture of experts (``deepseek.py``: sigmoid routing with a score correction bias and groups, renormalised and
scaled; ungated shared experts; dense layers before ``first_k_dense_replace``).

Partial rotary runs on the full-width rotary kernels: the q/k rows (and biases, and q/k norm weights) of each head
are reordered at load (``weight_loading.partial_rotary_checkpoint``). The multi-token-prediction layer the checkpoints
carry past the last decoder layer is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.models.deepseek import dense_or_moe, sigmoid_routing_rule
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.weight_loading import (
    STACKED_EXPERTS,
    STACKED_QKV_GATE_UP,
    WeightMapping,
    partial_rotary_checkpoint,
)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5 family (module docstring)."""

    qkv_bias, o_proj_bias = None, False
    qk_norm = None  # the config's use_qk_norm
    partial_rotary = True
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, experts=STACKED_EXPERTS, skip=("rotary_emb.inv_freq",))

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        return dense_or_moe(cfg, layer_idx, dtype, quant_config, prefix,
                            lambda: (sigmoid_routing_rule(cfg, cls.__name__), True))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(partial_rotary_checkpoint(weights, self.config))
