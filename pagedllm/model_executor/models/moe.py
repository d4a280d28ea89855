"""Mixture-of-experts decoders of the Llama shape: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE (gpt-oss:
``gpt_oss.py``).

The decoder layer is Llama's (``llama.py``); its feed-forward block is a ``SparseMoeBlock``: a router, the fused
experts (``layers/fused_moe``) and, for Qwen2-MoE, a shared expert every token runs, scaled by a sigmoid gate.

    x -> router logits [T, E] -> FusedMoE (top-k, grouped experts, weighted sum) (+ sigmoid(g(x)) * shared(x))

Each family's routing rule is transformers' (``routing.py``); a config asking for a rule this file does not
implement (grouped routing, a score correction bias, a scaling factor) is refused at load, naming the setting.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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
        if self.shared_expert is None:
            return self.experts(x, self.gate(x))
        # The experts add the gated shared expert (in their C++ combine where they route in C++: no torch op left).
        return self.experts(x, self.gate(x), shared=(self.shared_expert(x), self.shared_expert_gate(x)))


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


class OlmoeForCausalLM(Qwen3MoeForCausalLM):
    """OLMoE: Qwen3-MoE's routing (softmax then top-k, renormalised when ``norm_topk_prob``); its q/k RMSNorms span
    the whole projection (all heads together) and ``clip_qkv`` clamps q, k and v. Tensor parallelism is refused (the
    norms would need every head's sum of squares)."""

    qk_norm_per_head = False

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        check_routing_config(cfg)
        rule = RoutingRule(cfg.num_experts, cfg.num_experts_per_tok, "softmax_topk",
                           renormalize=bool(getattr(cfg, "norm_topk_prob", False)))
        return SparseMoeBlock(rule, cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"),
                              dtype=dtype, quant_config=quant_config, prefix=prefix)


# Granite-MoE experts' down projections: as its checkpoints save them, and as transformers 5 holds them.
_GRANITE_DOWN = ("block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj")


class GraniteMoeForCausalLM(LlamaForCausalLM):
    """Granite-MoE: top-k router logits then a softmax over those k; experts stored fused (``input_linear`` [E, 2I, H]
    rows [gate | up], ``output_linear`` [E, H, I]); four scalars transformers applies in its forward:
    ``embedding_multiplier`` (input embeddings), ``attention_multiplier`` (the attention scale, instead of
    1/sqrt(d)), ``residual_multiplier`` (each attention and MoE output before its residual add: folded into o_proj's
    and the experts' down projections as they load) and ``logits_scaling`` (logits divided by it)."""

    weight_mapping = WeightMapping(
        stacked=STACKED_QKV_GATE_UP, skip=("rotary_emb.inv_freq",),
        renames=(("block_sparse_moe.input_linear.weight", "mlp.experts.gate_up_proj"),
                 ("block_sparse_moe.output_linear.weight", "mlp.experts.down_proj"),
                 ("block_sparse_moe.router.layer.", "mlp.gate.")))

    @classmethod
    def attention_scale(cls, cfg: Any) -> float | None:
        return float(cfg.attention_multiplier)

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        if getattr(cfg, "shared_intermediate_size", 0):
            raise ValueError("GraniteMoeForCausalLM: shared_intermediate_size (Granite-MoE-Shared's shared expert) "
                             "is not supported")
        rule = RoutingRule(cfg.num_local_experts, cfg.num_experts_per_tok, "topk_softmax")
        return SparseMoeBlock(rule, cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"),
                              dtype=dtype, quant_config=quant_config, prefix=prefix)

    @classmethod
    def embedding_scale(cls, cfg: Any) -> float | None:
        return float(cfg.embedding_multiplier)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] float32, divided by ``logits_scaling``."""
        logits = super().compute_logits(hidden, out)
        return logits.div_(float(self.config.logits_scaling))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._residual_folded(weights))

    def _residual_folded(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each layer's output projections (attention's o_proj, the experts' down) times ``residual_multiplier``."""
        scale = float(self.config.residual_multiplier)
        for name, tensor in weights:
            if scale != 1.0 and (".self_attn.o_proj." in name or name.endswith(_GRANITE_DOWN)):
                tensor = tensor * scale
            yield name, tensor
