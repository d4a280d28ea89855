"""The sampling state of the runner's requests, kept from step to step (vLLM v1's persistent batch idea).

A request takes a *slot* when the runner adds it and gives it back when it finishes or is preempted. Every
sampler stage (``sample/stages.py``) and the draw keep their per-request values in per-slot columns,
written once from the request's SamplingParams when it arrives (``update_state`` with a ``BatchUpdate``).
Each step then gathers the rows it samples by slot with one numpy indexing per column
(``SamplingBatch.metadata``), so no step walks the SamplingParams of its rows again. Rows are gathered,
never stored in step order, so nothing moves when requests come and go. Draft verification asks the same
state for k + 1 rows of one request, each seeing the drafts before it as outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams


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
    grammar_bitmask: torch.Tensor | None = None
    decoding_rules: Any = None


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


class SamplingBatch:
    """Slots for the runner's requests and the stages' state over them; builds each step's SamplingMetadata.

    ``stages``: the sampler's stages (``Sampler(batch.stages)`` applies the same objects). Add and remove
    requests with ``update``; ``metadata`` gathers a step's rows.
    """

    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device | str,
                 stages: list[Any] | None = None) -> None:
        from pagedllm.sample.stages import DrawRows, default_stages

        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.stages = stages if stages is not None else default_stages()
        self.draw_rows = DrawRows()
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = []
        self._prompts: list[list[int]] = []
        self._outputs: list[list[int]] = []

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def update(self, removed: Sequence[str] = (),
               added: Sequence[tuple[str, SamplingParams, list[int], list[int], torch.Generator | None]] = ()
               ) -> None:
        """Free the slots of ``removed`` request ids (unknown ids are ignored), then give each ``added``
        ``(req_id, params, prompt_token_ids, output_token_ids, generator)`` a slot (an id already present is
        replaced). Every stage sees the change as one BatchUpdate; a step that changes nothing costs nothing."""
        if not removed and not added:
            return
        freed = []
        for req_id in [*removed, *(entry[0] for entry in added)]:
            slot = self._slot_of.pop(req_id, None)
            if slot is not None:
                freed.append(slot)
                self._prompts[slot], self._outputs[slot] = [], []
        self._free.extend(freed)
        rows = []
        for req_id, params, prompt, outputs, generator in added:
            if self._free:
                slot = self._free.pop()
            else:
                slot = len(self._prompts)
                self._prompts.append([])
                self._outputs.append([])
            self._slot_of[req_id] = slot
            self._prompts[slot], self._outputs[slot] = prompt, outputs
            rows.append(AddedRow(slot, params, prompt, outputs, generator))
        update = BatchUpdate(self.vocab_size, self.eos_token_ids, len(self._prompts), removed=freed, added=rows)
        self.draw_rows.update_state(update)
        for stage in self.stages:
            stage.update_state(update)

    def metadata(self, req_ids: Sequence[str], pending: Sequence[Sequence[int]] | None = None,
                 grammar_rows: list[int] | None = None, grammar_bitmask: torch.Tensor | None = None,
                 decoding_rules: Any = None) -> SamplingMetadata:
        """The SamplingMetadata of N rows, row i scoring request ``req_ids[i]`` (ids may repeat).

        ``pending[i]``: tokens row i sees after the request's outputs so far (the drafts before a verified
        position); ``grammar_rows`` / ``grammar_bitmask`` [len(grammar_rows), ceil(V/32)] int32: the rows
        under a grammar and the tokens each may take next; ``decoding_rules``: the model's own rules
        (``WhisperDecodingRules``).
        """
        words = (self.vocab_size + 31) // 32
        if grammar_rows and (grammar_bitmask is None or tuple(grammar_bitmask.shape) != (len(grammar_rows), words)):
            raise ValueError("grammar_bitmask must be [len(grammar_rows), ceil(V/32)]")
        if pending is not None and len(pending) != len(req_ids):
            raise ValueError("pending must have one entry per row")
        slot_of = self._slot_of
        slots = [slot_of[req_id] for req_id in req_ids]
        outputs = [self._outputs[s] for s in slots]
        if pending is not None:
            outputs = [out + list(extra) if extra else out for out, extra in zip(outputs, pending)]
        step = StepRows(np.asarray(slots, dtype=np.int64), outputs, [self._prompts[s] for s in slots],
                        self.vocab_size, self.device, grammar_rows, grammar_bitmask, decoding_rules)
        meta = SamplingMetadata(vocab_size=self.vocab_size)
        self.draw_rows.prepare(step, meta)
        for stage in self.stages:
            stage.prepare(step, meta)
        return meta
