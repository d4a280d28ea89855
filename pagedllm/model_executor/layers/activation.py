"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu import kernels_for


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] laid out [gate | up] -> silu(gate) * up, [T, I] (one fused pass on CPU)."""
    kernels = kernels_for(gate_up)
    if kernels is not None and gate_up.dim() == 2:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
