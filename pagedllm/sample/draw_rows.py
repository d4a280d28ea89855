"""The draw's per-request state (greedy or not, temperature, generator, logprobs wanted) and its gathering into a
step's ``SamplingMetadata`` fields, which the draw (``sample/draw.py``) and the temperature stage read."""

from __future__ import annotations

import numpy as np

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.stage_base import AddedRow, BatchUpdate, SlotRowState, StepRows, on_device
from pagedllm.sampling_params import SAMPLING_EPS


class DrawRows(SlotRowState):
    """What the draw needs per request: greedy or not, temperature, its own generator, logprobs wanted.

    Greedy slots hold temperature 1.0 so dividing by it is harmless; ``unseeded``: a random request without
    a generator (it takes the shared batched draw); ``logprobs`` -1 = not requested. ``using``: the random
    requests; ``logprob_slots``: those that want logprobs.
    """

    columns = {"greedy": (np.bool_, True), "temperature": (np.float32, 1.0), "unseeded": (np.bool_, False),
               "logprobs": (np.int64, -1)}

    def __init__(self) -> None:
        super().__init__()
        self.logprob_slots: set[int] = set()

    def forget(self, slot: int) -> None:
        super().forget(slot)
        self.logprob_slots.discard(slot)

    def add_row(self, row: AddedRow, update: BatchUpdate) -> bool:
        p, slot, cols = row.params, row.slot, self.rows
        if p.logprobs is not None:
            cols["logprobs"][slot] = p.logprobs
            self.logprob_slots.add(slot)
        if p.temperature < SAMPLING_EPS:
            return False
        cols["greedy"][slot] = False
        cols["temperature"][slot] = p.temperature
        if row.generator is not None:
            self.extras[slot] = row.generator
        else:
            cols["unseeded"][slot] = True
        return True

    def prepare(self, step: StepRows, meta: SamplingMetadata) -> None:
        slots, cols, num_rows = step.slots, self.rows, len(step.slots)
        meta.all_random = num_rows == 0
        if self.using:
            greedy = cols["greedy"][slots]
            meta.all_greedy = bool(greedy.all())
            meta.all_random = not greedy.any()
            if not meta.all_greedy:
                meta.temperature = on_device(cols["temperature"][slots], step.device)
                if not meta.all_random:
                    meta.greedy_mask = on_device(greedy, step.device)
                meta.has_unseeded_random = bool(cols["unseeded"][slots].any())
            if self.extras:
                meta.generators = {row: self.extras[slot] for row, slot in enumerate(slots.tolist())
                                   if slot in self.extras}
        if not self.logprob_slots:
            meta.num_logprobs = [None] * num_rows
            return
        wanted = cols["logprobs"][slots]
        meta.num_logprobs = [None if k < 0 else k for k in wanted.tolist()]
        if (wanted >= 0).any():
            meta.max_num_logprobs = int(wanted.max())
