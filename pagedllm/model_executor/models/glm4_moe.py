"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (``Glm4MoeForCausalLM``): Llama's decoder with q/k/v bias, optional per-head
q/k RMSNorm (``use_qk_norm``), rotary on half of each head (``partial_rotary_factor``), and DeepSeek-V3's
mixture of experts (``deepseek.py``: sigmoid routing with a score correction bias and groups, renormalised and
scaled; ungated shared experts; dense layers before ``first_k_dense_replace``).

Partial rotary runs on the full-width rotary kernels: the q/k rows (and biases, and q/k norm weights) of each head
are reordered at load (``rotary_embedding.partial_rotary_order``). The multi-token-prediction layer the checkpoints
carry past the last decoder layer is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.rotary_embedding import partial_rotary_factor, partial_rotary_order
from pagedllm.model_executor.models.blocks import GatedMLP, head_dim_of
from pagedllm.model_executor.models.deepseek import DeepseekMoE, beyond_the_decoder, sigmoid_routing_rule
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.weight_loading import STACKED_EXPERTS, STACKED_QKV_GATE_UP, WeightMapping

_HEAD_ROWS = (".self_attn.q_proj.", ".self_attn.k_proj.")
_NORMS = (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5 family (module docstring)."""

    qkv_bias, o_proj_bias = None, False
    qk_norm = None  # the config's use_qk_norm
    partial_rotary = True
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, experts=STACKED_EXPERTS, skip=("rotary_emb.inv_freq",))

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        if not cfg.n_routed_experts or layer_idx < cfg.first_k_dense_replace:
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "hidden_act", "silu"), dtype=dtype,
                            quant_config=quant_config, prefix=prefix)
        return DeepseekMoE(cfg, sigmoid_routing_rule(cfg, cls.__name__), True, dtype, quant_config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._glm_names(weights))

    def _glm_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint with the multi-token-prediction layer left out and each head's q/k dims reordered for the
        full-width rotary kernels."""
        cfg = self.config
        head_dim = head_dim_of(cfg)
        order = partial_rotary_order(head_dim, int(head_dim * partial_rotary_factor(cfg)))
        for name, tensor in weights:
            if beyond_the_decoder(name, cfg.num_hidden_layers):
                continue
            if any(f in name for f in _HEAD_ROWS):  # [heads * D, ...] weight or [heads * D] bias
                tensor = tensor.reshape(-1, head_dim, *tensor.shape[1:])[:, order].reshape(tensor.shape)
            elif name.endswith(_NORMS):
                tensor = tensor[order]
            yield name, tensor
