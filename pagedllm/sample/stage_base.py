"""What every sampler stage is built from: the stage interface, the batch's changes and a step's rows as a stage
sees them, and the per-slot columns a stage keeps its requests' values in.

A stage's per-request state lives in per-slot columns (``SlotRowState``): ``update_state`` writes a request's
values once when it joins the batch and resets them when it leaves; ``prepare`` gathers the step's rows into the
stage's own step state (``metadata.StepState``), or None when no row needs the stage this step; ``apply`` works in
place on the sampler's private float32 copy of the logits [N, V] (N rows, vocab V) with that state. Rows are
independent: a stage reads only per-row state, so several rows may belong to one request (speculative decoding
scores k+1 positions of a request in one call). Greedy rows carry neutral values (temperature 1, no truncation),
so after every stage their argmax is still the right token. Masked logits are set to -inf; the draw
(``sample/draw.py``) never picks a -inf logit while the row has a finite one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from pagedllm.host_to_device import to_device
from pagedllm.sample.metadata import SamplingMetadata, StepState
from pagedllm.sampling_params import SamplingParams


class LogitsStage(Protocol):
    """One step of logits processing, keeping its own per-request state and building its own step state.

    ``draw_fusion`` names what the draw can do in its own pass instead of the stage when the stage comes last
    (``Sampler.forward``): "temperature" (its step state has ``temperature`` [N] float32) or "bitmask" (``rows``
    [M] int64 and ``bitmask`` [M, ceil(V/32)] int32); None for the others.
    """

    name: str
    draw_fusion: str | None

    def update_state(self, update: BatchUpdate) -> None: ...

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> StepState | None:
        """This step's state, or None when no row needs the stage; ``meta`` holds the draw's fields (filled
        first), which a stage may read."""
        ...

    def apply(self, logits: torch.Tensor, state: Any) -> torch.Tensor:
        """logits [N, V] float32, changed in place and returned; ``state``: what ``prepare`` returned."""
        ...


class StatelessStage:
    """A stage whose step inputs come with the step (the grammar's bitmask) or from the draw's fields."""

    draw_fusion: str | None = None

    def update_state(self, update: BatchUpdate) -> None:
        pass


@dataclass
class AddedRow:
    """A request new to the batch: its slot, its sampling parameters and the lists the runner keeps for it
    (``output_token_ids`` is the runner's own list, read again each step, so appends are seen)."""

    slot: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None


@dataclass
class BatchUpdate:
    """What changed since the last step: slots freed first, then slots filled (a freed slot may be reused).

    ``capacity``: the number of slots every per-slot column must hold from now on.
    """

    vocab_size: int
    eos_token_ids: list[int]
    capacity: int
    removed: list[int] = field(default_factory=list)
    added: list[AddedRow] = field(default_factory=list)


@dataclass
class StepRows:
    """The N rows one sampling call scores: row i is slot ``slots[i]``; ``outputs[i]`` / ``prompts[i]`` are
    the tokens that row sees (a verified draft position sees the drafts before it as outputs)."""

    slots: np.ndarray  # [N] int64
    outputs: list[list[int]]
    prompts: list[list[int]]
    vocab_size: int
    device: torch.device
    grammar_rows: list[int] | None = None
    grammar_bitmask: torch.Tensor | None = None  # [len(grammar_rows), ceil(V/32)] int32


class SlotColumns:
    """Named per-slot numpy columns, each with the neutral value a free slot (or an unused option) holds."""

    def __init__(self, **columns: tuple[type, Any]) -> None:
        self._spec = columns
        self.capacity = 0
        self._data = {name: np.empty(0, dtype=dtype) for name, (dtype, _) in columns.items()}

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        capacity = max(capacity, 2 * self.capacity)  # requests arriving one a step do not copy every column each time
        for name, (dtype, neutral) in self._spec.items():
            grown = np.full(capacity, neutral, dtype=dtype)
            grown[:self.capacity] = self._data[name]
            self._data[name] = grown
        self.capacity = capacity

    def reset(self, slot: int) -> None:
        for name, (_, neutral) in self._spec.items():
            self._data[name][slot] = neutral

    def __getitem__(self, name: str) -> np.ndarray:
        return self._data[name]


class SlotRowState:
    """Base of a stage's per-slot state: columns that grow with the batch, reset when a slot is freed.

    A subclass names its ``columns`` and writes a new row in ``add_row``, which says whether the request uses
    the stage at all; ``using`` holds those slots (and the column ``in_use`` marks them), so a step whose batch
    holds none skips the stage without gathering anything, and ``used_rows`` finds the step's rows that do. It may
    keep sparse per-slot extras (``extras``: slot -> value) for the few requests that use an option.
    """

    columns: dict[str, tuple[type, Any]] = {}

    def __init__(self) -> None:
        self.rows = SlotColumns(in_use=(np.bool_, False), **self.columns)
        self.extras: dict[int, Any] = {}
        self.using: set[int] = set()

    def update_state(self, update: BatchUpdate) -> None:
        self.rows.grow(update.capacity)
        for slot in update.removed:
            self.forget(slot)
        for row in update.added:
            self.forget(row.slot)
            if self.add_row(row, update):
                self.using.add(row.slot)
                self.rows["in_use"][row.slot] = True

    def used_rows(self, step: StepRows) -> np.ndarray | None:
        """The step's rows (indices into ``step.slots``) whose requests use this stage; None when none do."""
        if not self.using:
            return None
        rows = np.flatnonzero(self.rows["in_use"][step.slots])
        return rows if rows.size else None

    def forget(self, slot: int) -> None:
        """Back to a free slot's neutral values."""
        self.rows.reset(slot)
        self.extras.pop(slot, None)
        self.using.discard(slot)

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        raise NotImplementedError


def on_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A gathered numpy column as a tensor on ``device`` (queued without a stream sync on CUDA)."""
    return to_device(torch.from_numpy(np.ascontiguousarray(values)), device)


def pad_rows(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """list of B token lists -> [B, max_len] int64 padded with ``pad`` (numpy: far cheaper than lists)."""
    width = max((len(r) for r in rows), default=0)
    arr = np.full((len(rows), max(width, 1)), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        if row:
            arr[i, : len(row)] = row
    return to_device(torch.from_numpy(arr), device)
