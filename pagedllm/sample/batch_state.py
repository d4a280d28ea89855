"""The sampling state of the runner's requests, kept from step to step (vLLM v1's persistent batch idea).

A request takes a *slot* when the runner adds it and gives it back when it finishes or is preempted. Every
sampler stage (``sample/stages/``) and the draw (``sample/draw_rows.py``) keep their per-request values in
per-slot columns, written once from the request's SamplingParams when it arrives (``update_state`` with a
``BatchUpdate``).
Each step then gathers the rows it samples by slot with one numpy indexing per column
(``SamplingBatch.metadata``), so no step walks the SamplingParams of its rows again. Rows are gathered,
never stored in step order, so nothing moves when requests come and go. Draft verification asks the same
state for k + 1 rows of one request, each seeing the drafts before it as outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedllm.sample.draw_rows import DrawRows
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.stage_base import AddedRow, BatchUpdate, LogitsStage, StepRows
from pagedllm.sample.stages import default_stages
from pagedllm.sampling_params import SamplingParams


class SamplingBatch:
    """Slots for the runner's requests and the stages' state over them; builds each step's SamplingMetadata.

    ``stages``: the sampler's stages (``Sampler(batch.stages)`` applies the same objects). Add and remove
    requests with ``update``; ``metadata`` gathers a step's rows.
    """

    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device | str,
                 stages: list[LogitsStage] | None = None) -> None:
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
                 grammar_rows: list[int] | None = None, grammar_bitmask: torch.Tensor | None = None
                 ) -> SamplingMetadata:
        """The SamplingMetadata of N rows, row i scoring request ``req_ids[i]`` (ids may repeat).

        ``pending[i]``: tokens row i sees after the request's outputs so far (the drafts before a verified
        position); ``grammar_rows`` / ``grammar_bitmask`` [len(grammar_rows), ceil(V/32)] int32: the rows
        under a grammar and the tokens each may take next. The draw's rows fill the draw's fields first; each
        stage then files its step state under its name, if some row needs it.
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
                        self.vocab_size, self.device, grammar_rows, grammar_bitmask)
        meta = SamplingMetadata(vocab_size=self.vocab_size)
        self.draw_rows.prepare(step, meta)
        steps = meta.steps
        for stage in self.stages:
            state = stage.prepare(step, meta)
            if state is not None:
                steps[stage.name] = state
        return meta


def build_sampling_metadata(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    eos_token_ids: list[int],
    vocab_size: int,
    device: torch.device,
    grammar_rows: list[int] | None = None,
    grammar_bitmask: torch.Tensor | None = None,
    stages: list[LogitsStage] | None = None,
) -> SamplingMetadata:
    """The metadata of a one-off batch, each row its own request (tests, the profiling step): a fresh
    ``SamplingBatch`` holding the rows, asked for one step. The runner keeps its batch across steps instead.

    ``params``, ``output_token_ids``, ``prompt_token_ids`` and ``generators`` are per row (length B).
    ``eos_token_ids`` are the model's EOS ids (shared by every row); they are masked alongside each row's
    ``stop_token_ids`` while that row has fewer than ``min_tokens`` outputs, unless it sets ``ignore_eos``.
    Token ids >= ``vocab_size`` in logit_bias / stop_token_ids are dropped (the front end should
    reject them with ``SamplingParams.verify_token_ids``). ``grammar_rows`` / ``grammar_bitmask``
    [len(grammar_rows), ceil(V/32)] int32: the rows under a grammar and the tokens each may take next
    (xgrammar's bitmask layout). ``stages``: the batch's stages (default: ``default_stages()``).
    """
    num_rows = len(params)
    if not (len(output_token_ids) == len(prompt_token_ids) == len(generators) == num_rows):
        raise ValueError("build_sampling_metadata: params, output_token_ids, prompt_token_ids and "
                         "generators must all have one entry per row")
    batch = SamplingBatch(vocab_size, eos_token_ids, device, stages)
    ids = [str(row) for row in range(num_rows)]
    batch.update(added=list(zip(ids, params, prompt_token_ids, output_token_ids, generators)))
    try:
        return batch.metadata(ids, grammar_rows=grammar_rows, grammar_bitmask=grammar_bitmask)
    except ValueError as e:
        raise ValueError(f"build_sampling_metadata: {e}") from None
