"""The per-step state of the torch and CPU backends (``meta.backend_state[TORCH_STATE_KEY]``): what they derive
from a step's metadata once and every layer reuses. The model runner has it built before the forward
(``TorchPagedAttentionBackend.build_state``); a piece nobody built is made by the first layer that asks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.attention.metadata import AttentionMetadata

TORCH_STATE_KEY = "torch"


@dataclass
class TorchStepState:
    paged_plan: Any = None  # torch_sdpa.AttentionPlan: fresh prompts vs requests with context
    encoder_plan: Any = None  # torch_encoder.EncoderAttentionPlan: the length buckets
    encoder_query_start: torch.Tensor | None = None  # [R + 1] int32 host offsets, for the C++ encoder kernel
    cross_layout: tuple[torch.Tensor, ...] | None = None  # cross_attention: one kernel request per query token


def torch_state(meta: AttentionMetadata) -> TorchStepState:
    """The torch and CPU backends' state of ``meta``'s step (created empty if nothing built it yet)."""
    state = meta.backend_state.get(TORCH_STATE_KEY)
    if state is None:
        state = meta.backend_state[TORCH_STATE_KEY] = TorchStepState()
    return state
