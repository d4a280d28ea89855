"""Quantized experts stacked for one kernel call per projection: on the CPU ``moe_quant_gemm``
(kernels/csrc/moe_quant_gemm.cpp) over panels, on CUDA Triton's ``moe_grouped_matmul`` (kernels/triton_moe.py) over
rows.

Each expert's projection is first bound as a ``Linear`` of the model's scheme (``FusedMoE._bind_expert`` /
``_bind_blocks``), so every format packs as its dense layers do; where all experts of a projection came out in the
same packed format, shape and group, their tensors are stacked along a first dimension [E, ...] and the per-expert
layers are dropped: the experts of a step then run in one kernel call that threads over (expert, panels), where
they were a Python loop of per-expert calls that a CPU step graph could not record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.kernels.triton_moe import StackedRows
from pagedllm.model_executor.layers.quantization.qpanels import (
    Fp8Panels,
    Int8Dot4Panels,
    Int8Panels,
    Q4Dot8Panels,
    Q4PairsPanels,
    QPanels,
)
from pagedllm.model_executor.layers.quantization.qrows import QRows

#: Panel format -> moe_quant_gemm's layout code (exact types: W8A8Panels, which quantizes x for many rows, is not one)
LAYOUTS: dict[type, int] = {Int8Panels: 0, Q4PairsPanels: 1, Fp8Panels: 2, Q4Dot8Panels: 3, Int8Dot4Panels: 4}


@dataclass
class StackedProjection:
    """One projection of every local expert: ``qweight`` [E, P, ...], ``scales`` (and 4-bit ``mins``)
    [E, P, K / group, 16] in the layout of ``LAYOUTS[type]``."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    layout: int
    group: int
    out_features: int
    in_features: int

    def __call__(self, kernels: Any, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """rows float32 [R, K] sorted by expert, ends int32 [E] -> [R, out_features]."""
        return kernels.moe_quant_gemm(rows, self.qweight, self.scales, self.mins, self.layout, self.group,
                                      self.out_features, ends)

    def expert(self, e: int) -> QPanels:
        """Expert ``e``'s packed weight (views of the stacks), as its layer held it."""
        kind = next(k for k, code in LAYOUTS.items() if code == self.layout)
        mins = self.mins[e] if self.mins is not None else None
        return kind(self.qweight[e], self.scales[e], mins, self.group, self.out_features, self.in_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)


def stack_projection(layers: list[Any]) -> StackedProjection | None:
    """The experts' ``Linear`` layers of one projection stacked, or None where their packed weights differ in format,
    shape, group or scale type (they then keep running one by one)."""
    packs = _same_packing(layers, tuple(LAYOUTS))
    if packs is None or type(packs[0]) not in LAYOUTS:  # exact types (W8A8Panels subclasses Int8Panels)
        return None
    first = packs[0]
    kind = type(first)
    mins = torch.stack([p.mins for p in packs]) if first.mins is not None else None
    return StackedProjection(torch.stack([p.qweight for p in packs]), torch.stack([p.scales for p in packs]), mins,
                             LAYOUTS[kind], first.group, first.out_features, first.in_features)


def _same_packing(layers: list[Any], kinds: Any) -> list[Any] | None:
    """The layers' packed weights where they share one format (of ``kinds``), shape, group and scale type and have
    no bias; else None."""
    packs = [getattr(layer, "packed", None) for layer in layers]
    first = packs[0]
    if not isinstance(first, kinds) or any(getattr(layer, "bias", None) is not None for layer in layers):
        return None
    for p in packs:
        if (type(p) is not type(first) or p.qweight.shape != first.qweight.shape or p.group != first.group
                or p.scales.dtype != first.scales.dtype or p.out_features != first.out_features):
            return None
    return packs


def stack_rows(layers: list[Any]) -> StackedRows | None:
    """The experts' ``Linear`` layers of one projection in the row layout (``QRows``, CUDA) stacked for
    ``moe_grouped_matmul``, or None where their packed weights differ (they then keep running one by one)."""
    packs = _same_packing(layers, QRows)
    if packs is None:
        return None
    first = packs[0]
    mins = torch.stack([p.mins for p in packs]) if first.mins is not None else None
    return StackedRows(torch.stack([p.qweight for p in packs]), torch.stack([p.scales for p in packs]), mins,
                       first.kind, first.group, first.out_features, first.in_features)
