"""MiniMax-M2 / M2.1 (``MiniMaxM2ForCausalLM``): Llama's decoder with q/k RMSNorms over the whole projections (all
heads together, as OLMoE), rotary on part of each head (``rotary_dim`` / ``partial_rotary_factor``), and a mixture
of experts on every layer: sigmoid router scores, the choice made on scores + ``e_score_correction_bias``, the k
weights the unbiased scores renormalised (``fused_moe/routing.py``'s ``sigmoid_topk``), no shared expert.

Checkpoints name the block ``block_sparse_moe`` with Mixtral's per-expert ``w1`` / ``w3`` / ``w2``. Partial rotary
runs on the full-width kernels: each head's q/k rows and its slice of the q/k norm weights are reordered at load
(``weight_loading.partial_rotary_checkpoint``). The norms span every head, so one rank holds the layer whole (no tensor
parallelism, as OLMoE).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.fused_moe import FusedMoE, RoutingRule
from pagedllm.model_executor.models.blocks import make_linear
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.weight_loading import (
    STACKED_EXPERTS,
    STACKED_QKV_GATE_UP,
    WeightMapping,
    partial_rotary_checkpoint,
)


class MiniMaxM2MoE(DirectCall, nn.Module):
    """Router (unquantized, in the model's dtype, as transformers runs it) + its score correction bias + the fused
    experts. x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: Any, dtype: torch.dtype, quant_config: Any, prefix: str) -> None:
        super().__init__()
        rule = RoutingRule(cfg.num_local_experts, cfg.num_experts_per_tok, "sigmoid_topk", renormalize=True)
        self.gate = make_linear(cfg.hidden_size, rule.num_experts, bias=False, dtype=dtype, prefix=f"{prefix}.gate")
        self.e_score_correction_bias = nn.Parameter(torch.empty(rule.num_experts, dtype=torch.float32),
                                                    requires_grad=False)
        self.experts = FusedMoE(rule, cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"),
                                dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x), correction_bias=self.e_score_correction_bias)


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    """MiniMax-M2 (module docstring)."""

    qkv_bias, o_proj_bias = False, False
    qk_norm = True
    qk_norm_per_head = False  # one RMSNorm over all of q's heads, one over k's
    partial_rotary = True
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, renames=(("block_sparse_moe.", "mlp."),),
                                   experts=STACKED_EXPERTS, skip=("rotary_emb.inv_freq",))

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        return MiniMaxM2MoE(cfg, dtype, quant_config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(partial_rotary_checkpoint(weights, self.config))
