"""Stages that mask the tokens a row may not take next: a request's ``allowed_token_ids``, its stop tokens while it
has fewer than ``min_tokens`` outputs, and its grammar (structured outputs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.host_to_device import tensor_on, to_device
from pagedllm.platforms import platform_of
from pagedllm.sample.metadata import SamplingMetadata, StepState
from pagedllm.sample.ops import unpack_bitmask
from pagedllm.sample.stage_base import AddedRow, BatchUpdate, SlotRowState, StatelessStage, StepRows, on_device


@dataclass(eq=False)
class AllowedTokensStep(StepState):
    rows: torch.Tensor  # [M] int64, the rows that set allowed_token_ids
    mask: torch.Tensor  # [M, V] bool, their allowed tokens


class AllowedTokensStage(SlotRowState):
    """Rows with ``allowed_token_ids``: every other token gets -inf."""

    name = "allowed_token_ids"
    draw_fusion = None

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        if row.params.allowed_token_ids is None:
            return False
        self.extras[row.slot] = [t for t in row.params.allowed_token_ids if t < update.vocab_size]
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> AllowedTokensStep | None:
        rows = self.used_rows(step)
        if rows is None:
            return None
        mask = np.zeros((rows.size, step.vocab_size), dtype=np.bool_)
        for j, slot in enumerate(step.slots[rows].tolist()):
            mask[j, self.extras[slot]] = True
        return AllowedTokensStep(on_device(rows.astype(np.int64), step.device), on_device(mask, step.device))

    def apply(self, logits: torch.Tensor, state: AllowedTokensStep) -> torch.Tensor:
        rows = logits.index_select(0, state.rows).masked_fill_(~state.mask, float("-inf"))
        return logits.index_copy_(0, state.rows, rows)


@dataclass(eq=False)
class MinTokensStep(StepState):
    """Sparse mask as parallel [M] int64 tensors: logits[rows[j], tokens[j]] = -inf."""

    rows: torch.Tensor
    tokens: torch.Tensor


class MinTokensStage(SlotRowState):
    """Stop tokens (EOS + stop_token_ids, EOS left out under ``ignore_eos``) are masked until a row has
    min_tokens outputs."""

    name = "min_tokens"
    draw_fusion = None
    columns = {"min_tokens": (np.int64, 0)}

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        p = row.params
        if p.min_tokens <= 0:
            return False
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids.update(update.eos_token_ids)
        self.rows["min_tokens"][row.slot] = p.min_tokens
        self.extras[row.slot] = [t for t in stop_ids if 0 <= t < update.vocab_size]
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> MinTokensStep | None:
        rows = self.used_rows(step)
        if rows is None:
            return None
        wanted = self.rows["min_tokens"][step.slots]
        mask_rows: list[int] = []
        mask_tokens: list[int] = []
        for row in rows.tolist():
            if len(step.outputs[row]) < wanted[row]:
                stop_ids = self.extras[int(step.slots[row])]
                mask_rows.extend([row] * len(stop_ids))
                mask_tokens.extend(stop_ids)
        if not mask_rows:
            return None
        return MinTokensStep(tensor_on(mask_rows, torch.int64, step.device),
                             tensor_on(mask_tokens, torch.int64, step.device))

    def apply(self, logits: torch.Tensor, state: MinTokensStep) -> torch.Tensor:
        logits[state.rows, state.tokens] = float("-inf")
        return logits


@dataclass(eq=False)
class GrammarStep(StepState):
    rows: torch.Tensor  # [M] int64, the rows under a grammar
    bitmask: torch.Tensor  # [M, ceil(V/32)] int32, bit j of word w allows token 32*w + j


class GrammarBitmaskStage(StatelessStage):
    """Tokens a row's grammar does not allow next get -inf (structured outputs); the step brings the
    bitmask. The CPU draw can read the bitmask itself (``draw_fusion``), with no [N, V] fill."""

    name = "grammar_bitmask"
    draw_fusion = "bitmask"

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> GrammarStep | None:
        if not step.grammar_rows:
            return None
        return GrammarStep(tensor_on(step.grammar_rows, torch.int64, step.device),
                           to_device(step.grammar_bitmask, step.device))

    def apply(self, logits: torch.Tensor, state: GrammarStep) -> torch.Tensor:
        rows, bitmask = state.rows, state.bitmask
        apply_cpu = platform_of(logits).grammar_bitmask_apply(logits.dtype)
        if apply_cpu is not None:
            full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
            full[rows] = bitmask
            apply_cpu(logits, full, vocab_size=logits.shape[1], indices=rows.tolist(), backend="cpu")
            return logits
        allowed = unpack_bitmask(bitmask, logits.shape[1])
        logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
        return logits
