"""``FusedMoE``: every expert MLP of one layer as one module, weights stacked per layer.

    x [T, H] --router logits--> top-k (routing.py) --> rows sorted by expert (grouping.py)
      --> per expert run: down(act(gate(x)) * up(x)) on that expert's rows only --> weighted, summed per token

Weights: ``gate_up_proj`` [E, 2 * I, H] (rows [gate | up] of each expert) and ``down_proj`` [E, H, I], the layout
transformers keeps in memory, filled from a checkpoint's per-expert tensors (``experts.{e}.gate_proj.weight``:
``WeightMapping.experts``) or from the fused 3D tensors some checkpoints store. Under tensor parallelism each rank
holds a slice of every expert's intermediate dimension (I / ranks) and the partial outputs are summed by one
all-reduce, as a row-parallel down projection would.

How the experts multiply (``process_weights_after_loading`` picks one, once):
- float weights: the grouped matmul over the sorted rows (``torch.nn.functional.grouped_mm``: one call per
  projection for all experts; experts with no rows are skipped, so a decode step reads only its k experts);
- a ``--quantization`` scheme: each expert's two projections bound once as the scheme's packed weights
  (``BoundWeight``, the same forms dense layers use), called for the experts that have rows this step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import all_reduce, get_tp
from pagedllm.logger import init_logger
from pagedllm.model_executor.layers.activation import gated_activation
from pagedllm.model_executor.layers.direct_call import DirectCall
from pagedllm.model_executor.layers.fused_moe.grouping import ExpertGroups, group_by_expert
from pagedllm.model_executor.layers.fused_moe.routing import RoutingRule, select_experts
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.parallel_linear import even_part
from pagedllm.model_executor.layers.quantization.base import set_weight_loader, to_empty_keeping_loaders

logger = init_logger(__name__)

GATE, UP = 0, 1  # row shards of gate_up_proj, the ``which`` of a per-expert tensor's (expert, which) shard id


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [R, K] sorted by expert, weights [E, N, K], ends [E] int32 -> rows[run e] @ weights[e]^T, [R, N].

    torch's grouped matmul needs rows of whole 16-byte multiples; other sizes (tiny test shapes) take the loop
    over the experts that have rows."""
    row_bytes = rows.element_size()
    if (weights.shape[1] * row_bytes) % 16 == 0 and (weights.shape[2] * row_bytes) % 16 == 0:
        return F.grouped_mm(rows.contiguous(), weights.transpose(1, 2), offs=ends)
    out = rows.new_empty(rows.shape[0], weights.shape[1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            torch.mm(rows[start:end], weights[expert].T, out=out[start:end])
        start = end
    return out


class FusedMoE(DirectCall, nn.Module):
    """The routed experts of one MoE layer (``rule.num_experts`` gated MLPs of ``intermediate_size`` each).

    ``forward(x [T, H], router_logits [T, E]) -> [T, H]``: the router weights applied and the k experts' outputs
    summed per token (all-reduced across tensor-parallel ranks).
    """

    def __init__(self, rule: RoutingRule, hidden_size: int, intermediate_size: int, act: str = "silu", *,
                 dtype: torch.dtype, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.rule, self.prefix, self.quant_config = rule, prefix, quant_config
        self.hidden_size = hidden_size
        tp = get_tp()
        self.tensor_parallel = tp.is_parallel
        self.part = even_part(intermediate_size, f"{prefix}: moe intermediate_size")  # this rank's slice of I
        num_experts, part = rule.num_experts, self.part.size
        self.gate_up_proj = set_weight_loader(
            nn.Parameter(torch.empty(num_experts, 2 * part, hidden_size, dtype=dtype), requires_grad=False),
            self._load_gate_up)
        self.down_proj = set_weight_loader(
            nn.Parameter(torch.empty(num_experts, hidden_size, part, dtype=dtype), requires_grad=False),
            self._load_down)
        self.act_and_mul = gated_activation(act)
        # Set by process_weights_after_loading: per expert (gate_up, down) Linear layers of the quantized scheme.
        self._quantized: list[tuple[Linear, Linear]] | None = None

    # -- loading --------------------------------------------------------------------------------------------------
    def num_loaded_shards(self, param_name: str) -> int:
        """How many (expert, which) shards fill ``param_name`` from per-expert tensors (the loader's check)."""
        return self.rule.num_experts * (2 if param_name == "gate_up_proj" else 1)

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None) -> None:
        """One expert's gate or up projection [I, H] (shard (expert, GATE | UP)), or all experts fused [E, 2I, H]
        with rows [gate | up] (shard None)."""
        full, part = self.part.full, self.part
        if shard_id is None:
            self._check(loaded, (self.rule.num_experts, 2 * full, self.hidden_size), "gate_up_proj")
            for which in (GATE, UP):
                rows = loaded.narrow(1, which * full + part.start, part.size)
                param.data.narrow(1, which * part.size, part.size).copy_(rows)
            return
        expert, which = shard_id
        self._check(loaded, (full, self.hidden_size), f"{expert}.{('gate', 'up')[which]}_proj")
        param.data[expert].narrow(0, which * part.size, part.size).copy_(loaded.narrow(0, part.start, part.size))

    def _load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None) -> None:
        """One expert's down projection [H, I] (shard (expert, 0)), or all experts fused [E, H, I] (shard None)."""
        part = self.part
        if shard_id is None:
            self._check(loaded, (self.rule.num_experts, self.hidden_size, part.full), "down_proj")
            param.data.copy_(loaded.narrow(2, part.start, part.size))
            return
        expert = shard_id[0]
        self._check(loaded, (self.hidden_size, part.full), f"{expert}.down_proj")
        param.data[expert].copy_(loaded.narrow(1, part.start, part.size))

    def _check(self, loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
        if not isinstance(loaded, torch.Tensor):
            raise ValueError(f"{self.prefix}.{what}: expert weights of type {type(loaded).__name__} are not supported")
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{self.prefix}.{what}: checkpoint {tuple(loaded.shape)}, model {expected}")

    def process_weights_after_loading(self) -> None:
        """Float weights stay stacked for the grouped matmul; a quantization scheme binds each expert's projections
        as its packed weights (the float stacks are then dropped)."""
        if self.quant_config is None or self._quantized is not None:
            return
        self._quantized = [(self._bind_expert(self.gate_up_proj[e], "gate_up_proj"),
                            self._bind_expert(self.down_proj[e], "down_proj"))
                           for e in range(self.rule.num_experts)]
        # The stacks become empty: the packed experts are the weights from here on.
        for name in ("gate_up_proj", "down_proj"):
            setattr(self, name, nn.Parameter(torch.empty(0, dtype=getattr(self, name).dtype), requires_grad=False))

    def _bind_expert(self, weight: torch.Tensor, name: str) -> Linear:
        """A Linear of the model's quantization scheme holding ``weight`` [N, K], packed for its kernel."""
        n, k = weight.shape
        with torch.device("meta"):
            layer = Linear(k, n, bias=False, dtype=weight.dtype, quant_config=self.quant_config,
                           prefix=f"{self.prefix}.{name}")
        layer = to_empty_keeping_loaders(layer, weight.device)
        layer.weight.weight_loader(layer.weight, weight.detach(), None)
        layer.process_weights_after_loading()
        return layer

    def weight_nbytes(self) -> int:
        """Bytes of the experts' weights as stored now (the stacks or the packed experts)."""
        if self._quantized is not None:
            return sum(a.weight_nbytes() + b.weight_nbytes() for a, b in self._quantized)
        return sum(p.numel() * p.element_size() for p in (self.gate_up_proj, self.down_proj))

    # -- forward --------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H] in x's dtype."""
        weights, ids = select_experts(router_logits, self.rule)
        groups = group_by_expert(weights, ids, self.rule.num_experts)
        rows = x.index_select(0, groups.token_of)  # [R, H]: each token once per chosen expert, by expert
        if self._quantized is not None:
            y = self._experts_quantized(rows, groups)
        else:
            y = self._experts_grouped(rows, groups)
        out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)
        out.index_add_(0, groups.token_of, y.float() * groups.weight)
        out = out.to(x.dtype)
        return all_reduce(out) if self.tensor_parallel else out

    def _experts_grouped(self, rows: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """Float stacks: rows [R, H] sorted by expert -> each row through its expert's MLP, [R, H]."""
        ends = groups.ends.to(rows.device)
        gate_up = grouped_matmul(rows, self.gate_up_proj, ends)
        return grouped_matmul(self.act_and_mul(gate_up), self.down_proj, ends)

    def _experts_quantized(self, rows: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """Packed experts: each expert with rows this step multiplies its run of ``rows`` [R, H] -> [R, H]. The
        loop visits only the experts that have rows (k per token at most)."""
        y = torch.empty(rows.shape[0], self.hidden_size, dtype=torch.float32, device=rows.device)
        ends = groups.ends.tolist()
        start = 0
        for expert, end in enumerate(ends):
            if end > start:
                gate_up, down = self._quantized[expert]
                y[start:end] = down(self.act_and_mul(gate_up(rows[start:end])))
            start = end
        return y

    def extra_repr(self) -> str:
        r = self.rule
        return (f"experts={r.num_experts}, top_k={r.top_k}, scoring={r.scoring}, renormalize={r.renormalize}, "
                f"hidden={self.hidden_size}, intermediate={self.part.size}/{self.part.full}")
