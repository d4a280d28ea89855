"""The per-step state of the torch and CPU backends (``meta.step_state(TorchStepState)``): what they derive from a
step's metadata once and every layer reuses. ``TorchPagedAttentionBackend.build_state`` builds it before the
forward, each piece for the specs of the layers that will read the step; the layers only read it, and a piece
that was not built raises (``missing``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagedllm.attention.backends.torch_encoder import EncoderAttentionPlan
    from pagedllm.attention.backends.torch_sdpa import AttentionPlan


@dataclass
class TorchStepState:
    paged_plan: AttentionPlan | None = None  # fresh prompts vs requests with context (causal, short sliding steps)
    encoder_plan: EncoderAttentionPlan | None = None  # encoder layers: the length buckets
    encoder_query_start: torch.Tensor | None = None  # [R + 1] int32 host offsets, for the C++ encoder kernel
    cross_layout: tuple[torch.Tensor, ...] | None = None  # cross_attention: one kernel request per query token


def torch_state(meta: AttentionMetadata) -> TorchStepState:
    """The torch and CPU backends' state of ``meta``'s step; RuntimeError if the step was not prepared."""
    return meta.step_state(TorchStepState)


def missing(piece: str) -> RuntimeError:
    """The error of a layer whose piece of the step's state was not built: the step was prepared for other
    layers' specs than the one asking."""
    return RuntimeError(f"attention: the step's TorchStepState has no {piece}; prepare_step was not given the spec "
                        "of this layer (prepare the step with step_readers of the model that runs it)")
