"""Mixture-of-experts decoders of the Llama shape: Mixtral, Qwen2-MoE, Qwen3-MoE.

The decoder layer is Llama's (``llama.py``); its feed-forward block is a ``SparseMoeBlock``: a router, the fused
experts (``layers/fused_moe``) and, for Qwen2-MoE, a shared expert every token runs, scaled by a sigmoid gate.

    x -> router logits [T, E] -> FusedMoE (top-k, grouped experts, weighted sum) (+ sigmoid(g(x)) * shared(x))

Each family's routing rule is transformers' (``routing.py``); a config asking for a rule this file does not
implement (grouped routing, a score correction bias, a scaling factor) is refused at load, naming the setting.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.fused_moe import FusedMoE, RoutingRule
from pagedllm.model_executor.models.blocks import GatedMLP, make_linear
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.weight_loading import STACKED_EXPERTS, STACKED_QKV_GATE_UP, WeightMapping

# Config settings of routers this file does not implement (DeepSeek-style grouped routing and its relatives):
# name -> the values that mean "not used".
_UNSUPPORTED_ROUTING = {"scoring_func": (None, "softmax"), "topk_method": (None, "greedy"), "n_group": (None, 0, 1),
                        "topk_group": (None, 0, 1), "routed_scaling_factor": (None, 1, 1.0),
                        "moe_router_enable_expert_bias": (None, False), "n_shared_experts": (None, 0)}


def check_routing_config(cfg: Any) -> None:
    """ValueError naming the first routing setting of ``cfg`` that the MoE families here do not implement."""
    arch = (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
    for name, plain in _UNSUPPORTED_ROUTING.items():
        value = getattr(cfg, name, None)
        if value not in plain:
            raise ValueError(f"{arch}: MoE routing setting {name}={value!r} is not supported (pagedllm routes with "
                             "softmax then top-k, or top-k then softmax, without groups, scaling or bias correction)")


class SparseMoeBlock(DirectCall, nn.Module):
    """Router + fused experts (+ an optional shared expert with a sigmoid gate). x [T, H] -> [T, H].

    The router and the shared expert's gate stay unquantized (a few rows; the routing decision is sensitive)."""

    def __init__(self, rule: RoutingRule, hidden_size: int, intermediate_size: int, act: str, *, dtype: torch.dtype,
                 quant_config: Any = None, prefix: str = "", shared_intermediate_size: int = 0) -> None:
        super().__init__()
        self.gate = make_linear(hidden_size, rule.num_experts, bias=False, dtype=dtype, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(rule, hidden_size, intermediate_size, act, dtype=dtype, quant_config=quant_config,
                                prefix=f"{prefix}.experts")
        self.shared_expert: GatedMLP | None = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, act, dtype=dtype,
                                          quant_config=quant_config, prefix=f"{prefix}.shared_expert")
            self.shared_expert_gate = make_linear(hidden_size, 1, bias=False, dtype=dtype,
                                                  prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: every layer's MLP is ``num_local_experts`` experts, softmax then top-k, the k weights renormalised."""

    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, renames=(("block_sparse_moe.", "mlp."),),
                                   experts=STACKED_EXPERTS, skip=("rotary_emb.inv_freq",))

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        check_routing_config(cfg)
        rule = RoutingRule(cfg.num_local_experts, cfg.num_experts_per_tok, "softmax_topk", renormalize=True)
        return SparseMoeBlock(rule, cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"),
                              dtype=dtype, quant_config=quant_config, prefix=prefix)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE: softmax then top-k (renormalised when ``norm_topk_prob``), a shared expert with a sigmoid gate;
    layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` are dense MLPs. q/k/v bias."""

    qkv_bias, o_proj_bias = True, False
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, experts=STACKED_EXPERTS, skip=("rotary_emb.inv_freq",))
    has_shared_expert = True

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        act = getattr(cfg, "hidden_act", "silu")
        sparse_step = getattr(cfg, "decoder_sparse_step", 1) or 1
        if layer_idx in (getattr(cfg, "mlp_only_layers", None) or []) or not cfg.num_experts \
                or (layer_idx + 1) % sparse_step:
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, act, dtype=dtype, quant_config=quant_config,
                            prefix=prefix)
        check_routing_config(cfg)
        rule = RoutingRule(cfg.num_experts, cfg.num_experts_per_tok, "softmax_topk",
                           renormalize=bool(getattr(cfg, "norm_topk_prob", False)))
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) if cls.has_shared_expert else 0
        return SparseMoeBlock(rule, cfg.hidden_size, cfg.moe_intermediate_size, act, dtype=dtype,
                              quant_config=quant_config, prefix=prefix, shared_intermediate_size=shared)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE: Qwen2-MoE's routing without the shared expert; Qwen3's per-head q/k RMSNorm, no q/k/v bias
    unless ``attention_bias``."""

    qkv_bias, o_proj_bias = None, None
    qk_norm = True
    has_shared_expert = False
