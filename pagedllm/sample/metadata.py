"""One step's sampler inputs: the draw's per-row tensors and each active stage's own step state.

The draw and the stages keep each request's values from the moment it joins the runner's batch
(``sample/batch_state.py``); ``SamplingBatch.metadata`` gathers a step's rows into this one object: the draw's
rows (``sample/draw_rows.py``) fill its fields, and each stage (``sample/stages/``) that some row needs this step
files its own step state under its name in ``steps``. Only the tensors some row needs are materialized.
Everything is per row, never per request: a request may own several rows (speculative decoding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


class StepState:
    """Base of a stage's step state (a dataclass declared with ``eq=False``): the per-row tensors and host values
    its ``apply`` reads. Two states are equal when they are of one type and every field is (tensors: same dtype,
    same values): a persistent batch's step equals a fresh batch's of the same rows."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                        and torch.equal(a, b)):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


@dataclass
class SamplingMetadata:
    """Sampling inputs for one step; row i is request i of the batch (B rows, vocab V).

    The draw's tensors that no row needs are ``None``; ``steps`` holds a state only for the stages some row
    needs this step (a stage without one does nothing).
    """

    vocab_size: int
    all_greedy: bool = True
    all_random: bool = True
    # [B] float32; 1.0 on greedy rows so dividing by it is harmless. None when all rows are greedy.
    temperature: torch.Tensor | None = None
    # [B] bool, True for greedy rows. None unless the batch mixes greedy and random rows.
    greedy_mask: torch.Tensor | None = None
    # Row index -> that request's own generator, for random rows only.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # True when some random row has no generator and so needs the shared batched noise draw.
    has_unseeded_random: bool = False
    # Max logprobs requested by any row (0 = only the sampled token), or None when no row wants logprobs.
    max_num_logprobs: int | None = None
    # Per-row requested logprobs count (None = not requested), so the engine can slice [B, k+1] results.
    num_logprobs: list[int | None] = field(default_factory=list)
    # Stage name -> that stage's step state, for the stages active this step, in no particular order.
    steps: dict[str, StepState] = field(default_factory=dict)
