"""The router's rule: which k experts each token goes to, and with what weights.

Families differ only in the order of softmax and top-k and in renormalisation, and that is where MoE ports go
wrong, so each rule is named after what transformers does:

- ``softmax_topk``: softmax over all experts in float32, then the top k; with ``renormalize`` the k weights are
  divided by their sum (Mixtral always; Qwen2-MoE / Qwen3-MoE / OLMoE when ``norm_topk_prob``).
- ``topk_softmax``: the top k logits, then a softmax over those k only (gpt-oss, Granite-MoE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORING = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class RoutingRule:
    """How router logits become (weights, expert ids): ``scoring`` one of ``SCORING``, ``top_k`` experts per token,
    ``renormalize`` the k weights of ``softmax_topk`` to sum to one."""

    num_experts: int
    top_k: int
    scoring: str = "softmax_topk"
    renormalize: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in SCORING:
            raise ValueError(f"MoE routing {self.scoring!r} is not supported (supported: {', '.join(SCORING)})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of experts "
                             f"({self.num_experts})")


def select_experts(router_logits: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), in top-k order."""
    if rule.scoring == "topk_softmax":
        top_logits, ids = torch.topk(router_logits, rule.top_k, dim=-1)
        return torch.softmax(top_logits.float(), dim=-1), ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, rule.top_k, dim=-1)
    if rule.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
