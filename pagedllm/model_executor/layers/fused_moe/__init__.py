"""Mixture-of-experts layers: the router's rule (``routing``), tokens grouped by expert (``grouping``) and the fused
experts of one layer (``layer.FusedMoE``)."""

from pagedllm.model_executor.layers.fused_moe.layer import FusedMoE
from pagedllm.model_executor.layers.fused_moe.routing import RoutingRule, select_experts

__all__ = ["FusedMoE", "RoutingRule", "select_experts"]
