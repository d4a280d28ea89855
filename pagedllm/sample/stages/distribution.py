"""Stages that shape the distribution random rows draw from: temperature, then top-k/top-p truncation, then
min-p. Greedy rows keep neutral values (temperature 1, no truncation), so their argmax is unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata, StepState
from pagedllm.sample.ops import apply_min_p, apply_top_k_top_p
from pagedllm.sample.stage_base import AddedRow, BatchUpdate, SlotRowState, StatelessStage, StepRows, on_device
from pagedllm.sampling_params import SAMPLING_EPS


@dataclass(eq=False)
class TemperatureStep(StepState):
    temperature: torch.Tensor  # [N] float32, 1.0 on greedy rows (the draw's own column)


class TemperatureStage(StatelessStage):
    """Divides random rows' logits by their temperature (``DrawRows`` keeps it: the draw needs it too).
    The draw can divide in its own pass when this stage comes last (``draw_fusion``)."""

    name = "temperature"
    draw_fusion = "temperature"

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> TemperatureStep | None:
        if meta.all_greedy:
            return None
        assert meta.temperature is not None
        return TemperatureStep(meta.temperature)

    def apply(self, logits: torch.Tensor, state: TemperatureStep) -> torch.Tensor:
        return logits.div_(state.temperature.unsqueeze(1))


@dataclass(eq=False)
class TopKTopPStep(StepState):
    # [N] int64, V = off. None when no row uses top-k.
    top_k: torch.Tensor | None
    # [N] float32, 1.0 = off. None when no row uses top-p.
    top_p: torch.Tensor | None
    # Largest active top-k (host int, so the op can call topk without a device sync).
    max_top_k: int
    # Some row uses top-p without top-k (forces a full-vocabulary sort).
    top_p_without_top_k: bool


class TopKTopPStage(SlotRowState):
    """Keeps each random row's top-k tokens, then its nucleus (top-p). ``top_k`` 0 = off (also greedy)."""

    name = "top_k_top_p"
    draw_fusion = None
    columns = {"top_k": (np.int64, 0), "top_p": (np.float32, 1.0)}

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        p = row.params
        top_k = p.top_k if 0 < p.top_k < update.vocab_size else 0
        if p.temperature < SAMPLING_EPS or (top_k == 0 and p.top_p >= 1.0):
            return False  # truncation is irrelevant for argmax: greedy rows keep the neutral values
        self.rows["top_p"][row.slot] = p.top_p
        self.rows["top_k"][row.slot] = top_k
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> TopKTopPStep | None:
        if not self.using:
            return None
        top_k = self.rows["top_k"][step.slots]
        top_p = self.rows["top_p"][step.slots]
        limited, nucleus = top_k > 0, top_p < 1.0
        use_top_k, use_top_p = bool(limited.any()), bool(nucleus.any())
        if not (use_top_k or use_top_p):
            return None
        state = TopKTopPStep(None, None, 0, False)
        if use_top_k:
            state.top_k = on_device(np.where(limited, top_k, step.vocab_size), step.device)
            state.max_top_k = int(top_k.max())
        if use_top_p:
            state.top_p = on_device(top_p, step.device)
            state.top_p_without_top_k = bool((nucleus & ~limited).any())
        return state

    def apply(self, logits: torch.Tensor, state: TopKTopPStep) -> torch.Tensor:
        return apply_top_k_top_p(logits, state.top_k, state.top_p, state.max_top_k, state.top_p_without_top_k)


@dataclass(eq=False)
class MinPStep(StepState):
    min_p: torch.Tensor  # [N] float32, 0.0 = off


class MinPStage(SlotRowState):
    """Masks tokens less likely than min_p times the row's most likely one (random rows; 0.0 = off)."""

    name = "min_p"
    draw_fusion = None
    columns = {"min_p": (np.float32, 0.0)}

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        if row.params.temperature < SAMPLING_EPS or row.params.min_p <= 0.0:
            return False
        self.rows["min_p"][row.slot] = row.params.min_p
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> MinPStep | None:
        if not self.using:
            return None
        min_p = self.rows["min_p"][step.slots]
        if not (min_p > 0.0).any():
            return None
        return MinPStep(on_device(min_p, step.device))

    def apply(self, logits: torch.Tensor, state: MinPStep) -> torch.Tensor:
        return apply_min_p(logits, state.min_p)
