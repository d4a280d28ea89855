"""The router's rule: which k experts each token goes to, and with what weights.

Families differ in the order of softmax and top-k, in renormalisation, in group limits and scaling, and that is
where MoE ports go wrong, so each rule is named after what transformers does:

- ``softmax_topk``: softmax over all experts in float32, then the top k; with ``renormalize`` the k weights are
  divided by their sum (Mixtral always; Qwen2-MoE / Qwen3-MoE / OLMoE when ``norm_topk_prob``). With groups
  (DeepSeek-V2's ``group_limited_greedy``) a group scores its best expert's probability and the experts of all but
  the ``topk_groups`` best groups score 0.
- ``topk_softmax``: the top k logits, then a softmax over those k only (gpt-oss, Granite-MoE).
- ``sigmoid_topk`` (DeepSeek-V3, Kimi K2: ``noaux_tc``): sigmoid scores; the choice ranks score + a per-expert
  correction bias (the weights stay the unbiased scores); with groups a group scores the sum of its two best
  biased scores and the experts of all but the ``topk_groups`` best groups are never chosen; ``renormalize``
  divides the k weights by their sum (+1e-20, as transformers).

``scaling`` (``routed_scaling_factor``) multiplies the final weights (DeepSeek-V2 / V3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORING = ("softmax_topk", "topk_softmax", "sigmoid_topk")


@dataclass(frozen=True)
class RoutingRule:
    """How router logits become (weights, expert ids): ``scoring`` one of ``SCORING``, ``top_k`` experts per token,
    ``renormalize`` the k weights to sum to one; experts in ``num_groups`` equal groups of which the
    ``topk_groups`` best are eligible; ``scaling`` on the final weights."""

    num_experts: int
    top_k: int
    scoring: str = "softmax_topk"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORING:
            raise ValueError(f"MoE routing {self.scoring!r} is not supported (supported: {', '.join(SCORING)})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the number of experts "
                             f"({self.num_experts})")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) must divide the number of experts ({self.num_experts})")
        if self.num_groups > 1:
            per_group = self.num_experts // self.num_groups
            if self.scoring == "topk_softmax":
                raise ValueError("n_group: grouped routing with top-k then softmax is not supported")
            if not 1 <= self.topk_groups <= self.num_groups:
                raise ValueError(f"topk_group ({self.topk_groups}) must be between 1 and n_group ({self.num_groups})")
            if self.top_k > self.topk_groups * per_group:
                raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the experts of topk_group "
                                 f"({self.topk_groups}) groups of {per_group}")
            if self.scoring == "sigmoid_topk" and per_group < 2:
                raise ValueError("n_group: sigmoid routing scores a group by its two best experts; each group "
                                 f"has {per_group}")

    @property
    def plain(self) -> bool:
        """Softmax and top-k in either order with no groups and no scaling: what the C++ routing kernel does."""
        return self.scoring != "sigmoid_topk" and self.num_groups == 1 and self.scaling == 1.0


def _group_mask(group_scores: torch.Tensor, rule: RoutingRule) -> torch.Tensor:
    """group_scores [T, G] -> bool [T, E], True for the experts of each token's ``topk_groups`` best groups."""
    best = torch.topk(group_scores, rule.topk_groups, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.repeat_interleave(rule.num_experts // rule.num_groups, dim=1)


def select_experts(router_logits: torch.Tensor, rule: RoutingRule,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64). ``correction_bias`` [E]: added to
    ``sigmoid_topk``'s scores for the choice only."""
    t, groups = router_logits.shape[0], rule.num_groups
    if rule.scoring == "topk_softmax":
        top_logits, ids = torch.topk(router_logits, rule.top_k, dim=-1)
        weights = torch.softmax(top_logits.float(), dim=-1)
    elif rule.scoring == "sigmoid_topk":
        scores = router_logits.float().sigmoid()
        choice = scores + correction_bias.float() if correction_bias is not None else scores
        if groups > 1:
            group_scores = choice.view(t, groups, -1).topk(2, dim=-1).values.sum(dim=-1)
            choice = choice.masked_fill(~_group_mask(group_scores, rule), float("-inf"))
        ids = torch.topk(choice, rule.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if rule.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        probs = torch.softmax(router_logits.float(), dim=-1)
        if groups > 1:
            probs = probs.masked_fill(~_group_mask(probs.view(t, groups, -1).amax(dim=-1), rule), 0.0)
        weights, ids = torch.topk(probs, rule.top_k, dim=-1)
        if rule.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * rule.scaling if rule.scaling != 1.0 else weights), ids
