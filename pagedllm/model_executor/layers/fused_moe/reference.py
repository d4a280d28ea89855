"""The MoE layer written the plain way, for tests only: every expert in a Python loop over the tokens routed to it,
on the float stacks. ``FusedMoE.forward`` must equal it; nothing on the serving path calls it."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers.fused_moe.routing import RoutingRule, select_experts


def reference_moe(x: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  rule: RoutingRule, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  act_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  correction_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], router_logits [T, E], gate_up_proj [E, 2I, H] (rows [gate | up]), down_proj [E, H, I] -> [T, H]:
    sum over the k chosen experts of weight * down(silu(gate(x)) * up(x)), in float32. Optional biases
    [E, 2I] / [E, H] and another gated activation ([R, 2I] -> [R, I]) as gpt-oss has."""
    weights, ids = select_experts(router_logits, rule, correction_bias)
    out = torch.zeros(x.shape[0], down_proj.shape[1], dtype=torch.float32)
    for expert in range(rule.num_experts):
        token, slot = torch.where(ids == expert)
        if token.numel() == 0:
            continue
        h = F.linear(x[token].float(), gate_up_proj[expert].float(),
                     None if gate_up_bias is None else gate_up_bias[expert].float())
        if act_and_mul is None:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = act_and_mul(h)
        y = F.linear(h, down_proj[expert].float(), None if down_bias is None else down_bias[expert].float())
        out.index_add_(0, token, y * weights[token, slot, None])
    return out
