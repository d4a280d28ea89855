"""gpt-oss: a Llama-shaped mixture-of-experts decoder with three twists in attention and three in the experts.

    attention: q/k/v/o biases; a learned sink logit per head in the softmax (``attention/backends/torch_sinks``);
               sliding-window and full layers alternating (``config.layer_types``, 128-token window)
    experts:   router with a bias, top-k logits then a softmax over those k (``topk_softmax``); every expert's
               projections have biases; the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``
               (``ClampedSwiGLU``)

The checkpoint stores each layer's experts fused and transposed, gate and up interleaved by column:
``experts.gate_up_proj`` [E, H, 2I] (gate = columns 0, 2, 4 ..., up = 1, 3, 5 ...), ``gate_up_proj_bias`` [E, 2I]
likewise, ``down_proj`` [E, I, H]; they are turned into ``FusedMoE``'s [E, 2I, H] rows [gate | up] and [E, H, I]
as they load. The released checkpoints keep the experts in MXFP4 (``*_blocks`` / ``*_scales``): not loaded here
(a clear error); bf16 / float32 checkpoints (dequantized ones, tiny test models) are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.model_executor.layers.activation import ClampedSwiGLU
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.fused_moe import FusedMoE, RoutingRule
from pagedllm.model_executor.models.blocks import make_linear
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.weight_loading import STACKED_QKV_GATE_UP, WeightMapping


class GptOssMoeBlock(DirectCall, nn.Module):
    """Router (with bias, unquantized) + the fused experts with biases and the clamped SwiGLU. x [T, H] -> [T, H]."""

    def __init__(self, cfg: Any, dtype: torch.dtype, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        rule = RoutingRule(cfg.num_local_experts, cfg.num_experts_per_tok, "topk_softmax")
        self.router = make_linear(cfg.hidden_size, rule.num_experts, bias=True, dtype=dtype, prefix=f"{prefix}.router")
        self.experts = FusedMoE(rule, cfg.hidden_size, cfg.intermediate_size,
                                ClampedSwiGLU(getattr(cfg, "swiglu_alpha", 1.702), cfg.swiglu_limit), dtype=dtype,
                                quant_config=quant_config, prefix=f"{prefix}.experts", bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.experts(x, self.router(x))


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Columns (gate, up, gate, up ...) along ``dim`` -> [all gates | all ups]."""
    before = (slice(None),) * dim
    return torch.cat([t[(*before, slice(0, None, 2))], t[(*before, slice(1, None, 2))]], dim=dim)


def experts_as_fused_moe(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's expert tensors in ``FusedMoE``'s layout (the module docstring); other tensors pass unchanged.
    ValueError for MXFP4 expert blocks."""
    for name, tensor in weights:
        if name.endswith(("_blocks", "_scales")) and ".experts." in name:
            raise ValueError(f"{name}: gpt-oss's MXFP4 expert weights are not supported; load a checkpoint with "
                             "bf16 or float32 experts (dequantized)")
        if name.endswith(".experts.gate_up_proj"):
            tensor = _deinterleave(tensor.transpose(1, 2), dim=1)  # [E, H, 2I] -> [E, 2I, H], rows [gate | up]
        elif name.endswith(".experts.gate_up_proj_bias"):
            tensor = _deinterleave(tensor, dim=1)
        elif name.endswith(".experts.down_proj"):
            tensor = tensor.transpose(1, 2)  # [E, I, H] -> [E, H, I]
        yield name, tensor


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss (20b, 120b): Llama's decoder layer with attention sinks and ``GptOssMoeBlock`` feed-forwards; the
    q/k/v/o biases follow ``attention_bias``."""

    attention_sinks = True
    weight_mapping = WeightMapping(stacked=STACKED_QKV_GATE_UP, renames=(("self_attn.sinks", "self_attn.attn.sinks"),),
                                   skip=("rotary_emb.inv_freq",))

    @classmethod
    def make_mlp(cls, cfg: Any, layer_idx: int, dtype: torch.dtype, quant_config: Any, prefix: str) -> nn.Module:
        return GptOssMoeBlock(cfg, dtype, quant_config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(experts_as_fused_moe(weights))
