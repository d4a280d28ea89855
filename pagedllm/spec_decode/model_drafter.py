"""Drafting with a model: a separate small model (``draft_model``) or the target's first layers
(``layer_skip``), run through the same paged attention and block tables as the target.

Each step the drafter first runs a *catch-up pass* over the tokens that became valid this step (for a
separate draft model: every token the target computed plus the newly sampled one, so its own KV cache
tracks the target's; for layer-skip only the newly sampled token, since the target already wrote those
layers' K/V), then ``k - 1`` one-token steps on its own proposals. The proposals' K/V lands in the
lookahead slots the scheduler reserved; the verification pass overwrites it with the same values where
drafts are accepted and with the real tokens' values where they are not.

Proposals stay on the device from one step to the next (each one-token pass reads the previous pass's
tokens); the host reads all drafts once, after the last pass.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.host_to_device import index_rows, tensor_on
from pagedllm.model_executor.layers.attention import StepReaders, attention_step, step_readers
from pagedllm.sample.draw import draw_drafts
from pagedllm.sampling_params import SAMPLING_EPS
from pagedllm.spec_decode.proposer import DraftJob, Proposals, Proposer


def layer_skip_forward(model: nn.Module, num_layers: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The target's own decoder stack run over its first ``num_layers`` layers (then its final norm), as a
    draft model: ``model.model.forward(input_ids, positions, num_layers=...)``.

    Only decoder stacks whose layers all index one KV cache group take ``num_layers`` (the Llama family):
    the drafter passes one block table.
    """
    inner = getattr(model, "model", None)
    forward = getattr(inner, "forward", None)
    if forward is None or "num_layers" not in inspect.signature(forward).parameters:
        raise ValueError(f"speculative_config.method: layer_skip needs a Llama-style model; "
                         f"{type(model).__name__} does not expose its layers")

    def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return inner(input_ids, positions, num_layers=num_layers)

    return run


class ModelDrafter(Proposer):
    """Proposes drafts with ``forward`` (input_ids [T], positions [T] -> hidden [T, H]) and
    ``compute_logits`` (hidden [N, H] -> logits [N, V] float32).

    Random requests draw drafts from softmax(logits / temperature) and keep that distribution
    (``Proposals.probs``) for the verifier; greedy requests take the argmax (the sampler's ``draw_drafts``).
    ``layers``: the module whose attention layers ``forward`` runs (the draft model, or the target for layer-skip);
    each pass prepares their backends' state for its metadata, as the model runner does for its steps. None: a
    ``forward`` with no attention layers.
    """

    writes_kv = True

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 compute_logits: Callable[[torch.Tensor], torch.Tensor], block_size: int,
                 device: torch.device, catches_up_all: bool = False, layers: nn.Module | None = None) -> None:
        self.forward = forward
        self.compute_logits = compute_logits
        self.block_size = block_size
        self.device = device
        self.catches_up_all = catches_up_all
        self.layers = layers
        # Who reads each pass's metadata (step_readers of ``layers``): found at the first pass, once the engine has
        # bound the layers' backends and caches.
        self._readers: StepReaders | None = None

    def _run(self, input_ids: torch.Tensor, parts: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """input_ids [T] (requests' tokens back to back, decodes first); parts: (first position, number of
        tokens, block ids) per request -> hidden [T, H]."""
        query_lens = [n for _, n, _ in parts]
        seq_lens = [start + n for start, n, _ in parts]
        meta = build_attention_metadata(query_lens, seq_lens, [blocks for _, _, blocks in parts], self.block_size,
                                        self.device)
        positions = tensor_on([p for start, n, _ in parts for p in range(start, start + n)], torch.long,
                              self.device)
        if self._readers is None:
            self._readers = step_readers(self.layers) if self.layers is not None else []
        with attention_step(meta, self._readers):
            return self.forward(input_ids, positions)

    @torch.inference_mode()
    def propose_batch(self, jobs: list[DraftJob]) -> Proposals:
        """Drafts per proposing request and, for random ones, their distributions [k, V]."""
        jobs = sorted((j for j in jobs if j.end > j.start), key=lambda j: j.end - j.start != 1)
        if not jobs:
            return Proposals()
        ids = tensor_on([t for j in jobs for t in j.token_ids[j.start:j.end]], torch.long, self.device)
        hidden = self._run(ids, [(j.start, j.end - j.start, j.block_ids) for j in jobs])
        last_rows, row = [], -1
        for j in jobs:
            row += j.end - j.start
            last_rows.append(row)
        active = [(j, r) for j, r in zip(jobs, last_rows) if j.num_drafts > 0]
        # Per request its draft tokens as (pass, row in that pass); per pass its tokens [M] on the device.
        taken: dict[str, list[tuple[int, int]]] = {j.req_id: [] for j, _ in active}
        passes: list[torch.Tensor] = []
        probs: dict[str, list[torch.Tensor]] = {}
        while active:
            logits = self.compute_logits(index_rows(hidden, [r for _, r in active]))
            tokens, step_probs = draw_drafts(logits, [j.temperature for j, _ in active],
                                             [j.generator for j, _ in active])
            for row, (job, _) in enumerate(active):
                taken[job.req_id].append((len(passes), row))
                if step_probs is not None and job.temperature >= SAMPLING_EPS:
                    probs.setdefault(job.req_id, []).append(step_probs[row])
            passes.append(tokens)
            still = [(row, j) for row, (j, _) in enumerate(active) if len(taken[j.req_id]) < j.num_drafts]
            if not still:
                break
            # The next one-token pass reads this pass's tokens where they are: no trip through the host.
            step = len(passes)
            ids = index_rows(tokens.unsqueeze(1), [row for row, _ in still]).squeeze(1)
            hidden = self._run(ids, [(j.end + step - 1, 1, j.block_ids) for _, j in still])
            active = [(j, row) for row, (_, j) in enumerate(still)]
        flat = torch.cat(passes).tolist() if passes else []  # the one sync: every draft of the step
        offsets = [0]
        for tokens in passes:
            offsets.append(offsets[-1] + tokens.shape[0])
        drafts = {rid: [flat[offsets[p] + r] for p, r in cells] for rid, cells in taken.items()}
        return Proposals(drafts, {rid: torch.stack(rows) for rid, rows in probs.items()})


def make_draft_model_drafter(draft_model: Any, block_size: int, device: torch.device) -> ModelDrafter:
    """A separate draft model: it catches up on every token the target computed (its own KV cache)."""
    return ModelDrafter(draft_model, draft_model.compute_logits, block_size, device, catches_up_all=True,
                        layers=draft_model)


def make_layer_skip_drafter(target: Any, num_layers: int, block_size: int, device: torch.device) -> ModelDrafter:
    """The target's first ``num_layers`` layers and its head (those layers' K/V is the target's own)."""
    return ModelDrafter(layer_skip_forward(target, num_layers), target.compute_logits, block_size, device,
                        layers=target)
