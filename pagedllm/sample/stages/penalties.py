"""Stages that move a request's logits by what it asked for: its ``logit_bias``, and presence, frequency and
repetition penalties over the tokens it has seen."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.host_to_device import tensor_on
from pagedllm.sample.metadata import SamplingMetadata, StepState
from pagedllm.sample.ops import apply_penalties
from pagedllm.sample.stage_base import AddedRow, BatchUpdate, SlotRowState, StepRows, on_device, pad_rows


@dataclass(eq=False)
class LogitBiasStep(StepState):
    """Sparse bias as parallel [M] tensors: logits[rows[j], tokens[j]] += values[j]."""

    rows: torch.Tensor  # int64
    tokens: torch.Tensor  # int64
    values: torch.Tensor  # float32


class LogitBiasStage(SlotRowState):
    """Adds each request's ``logit_bias`` (ids past the vocabulary dropped) to its rows."""

    name = "logit_bias"
    draw_fusion = None

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        bias = [(t, v) for t, v in (row.params.logit_bias or {}).items() if t < update.vocab_size]
        if not bias:
            return False
        self.extras[row.slot] = ([t for t, _ in bias], [v for _, v in bias])
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> LogitBiasStep | None:
        rows = self.used_rows(step)
        if rows is None:
            return None
        bias_rows: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for row, slot in zip(rows.tolist(), step.slots[rows].tolist()):
            row_tokens, row_values = self.extras[slot]
            bias_rows.extend([row] * len(row_tokens))
            tokens.extend(row_tokens)
            values.extend(row_values)
        return LogitBiasStep(tensor_on(bias_rows, torch.int64, step.device),
                             tensor_on(tokens, torch.int64, step.device),
                             tensor_on(values, torch.float32, step.device))

    def apply(self, logits: torch.Tensor, state: LogitBiasStep) -> torch.Tensor:
        return logits.index_put_((state.rows, state.tokens), state.values, accumulate=True)


@dataclass(eq=False)
class PenaltiesStep(StepState):
    # [B, Lo] int64 padded with V; only rows with some penalty are filled.
    output_token_ids: torch.Tensor
    # [B, Lp] int64 padded with V; only rows with a repetition penalty are filled. None when no row has one.
    prompt_token_ids: torch.Tensor | None
    # [B] float32 each (0, 0, 1 = off).
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor


class PenaltiesStage(SlotRowState):
    """Presence, frequency (output tokens) and repetition (prompt + output tokens) penalties."""

    name = "penalties"
    draw_fusion = None
    columns = {"presence": (np.float32, 0.0), "frequency": (np.float32, 0.0), "repetition": (np.float32, 1.0),
               "repeats": (np.bool_, False)}

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        p, slot, cols = row.params, row.slot, self.rows
        penalized = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        if not penalized:
            return False
        cols["presence"][slot] = p.presence_penalty
        cols["frequency"][slot] = p.frequency_penalty
        cols["repetition"][slot] = p.repetition_penalty
        cols["repeats"][slot] = p.repetition_penalty != 1.0
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> PenaltiesStep | None:
        if self.used_rows(step) is None:
            return None
        slots, cols = step.slots, self.rows
        penalized, repeats = cols["in_use"][slots], cols["repeats"][slots]
        # Rows without penalties contribute empty lists so long unrelated sequences do not widen the pad.
        output_ids = pad_rows([out if on else [] for out, on in zip(step.outputs, penalized.tolist())],
                              step.vocab_size, step.device)
        prompt_ids = None
        if repeats.any():
            prompt_ids = pad_rows([p if on else [] for p, on in zip(step.prompts, repeats.tolist())],
                                  step.vocab_size, step.device)
        return PenaltiesStep(output_ids, prompt_ids, on_device(cols["presence"][slots], step.device),
                             on_device(cols["frequency"][slots], step.device),
                             on_device(cols["repetition"][slots], step.device))

    def apply(self, logits: torch.Tensor, state: PenaltiesStep) -> torch.Tensor:
        apply_penalties(logits, state.output_token_ids, state.prompt_token_ids, state.presence_penalties,
                        state.frequency_penalties, state.repetition_penalties)
        return logits
