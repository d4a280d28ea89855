"""Drafting with a model: a separate small model (``draft_model``) or the target's first layers
(``layer_skip``), run through the same paged attention and block tables as the target.

Each step the drafter first runs a *catch-up pass* over the tokens that became valid this step (for a
separate draft model: every token the target computed plus the newly sampled one, so its own KV cache
tracks the target's; for layer-skip only the newly sampled token, since the target already wrote those
layers' K/V), then ``k - 1`` one-token steps on its own proposals. The proposals' K/V lands in the
lookahead slots the scheduler reserved; the verification pass overwrites it with the same values where
drafts are accepted and with the real tokens' values where they are not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.attention.forward_context import forward_context
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.sampling_params import SAMPLING_EPS


@dataclass
class DraftJob:
    """Run positions [start, end) of ``token_ids`` through the drafter; then propose ``num_drafts``
    tokens after position end - 1 (0: catch-up only)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int
    num_drafts: int
    temperature: float
    generator: torch.Generator | None


def layer_skip_forward(model: nn.Module, num_layers: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The target's embedding, first ``num_layers`` decoder layers and final norm, as a draft model.

    Uses the Llama-family module layout (``model.model.{embed_tokens, layers, norm, rotary_emb}``).
    """
    from pagedllm.model_executor.layers.rotary_embedding import RopeStep

    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise ValueError(f"speculative_config.method: layer_skip needs a Llama-style model; "
                         f"{type(model).__name__} does not expose its layers")
    layers = inner.layers[:num_layers]

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = inner.embed_tokens(input_ids)
        rope = RopeStep(inner.rotary_emb, positions)
        residual = None
        for layer in layers:
            x, residual = layer(x, residual, rope)
        x, _ = inner.norm(x, residual)
        return x

    return forward


class ModelDrafter:
    """Proposes drafts with ``forward`` (input_ids [T], positions [T] -> hidden [T, H]) and
    ``compute_logits`` (hidden [N, H] -> logits [N, V] float32).

    Random requests draw drafts from softmax(logits / temperature) and keep that distribution
    (``draft_probs``) for the verifier; greedy requests take the argmax.
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 compute_logits: Callable[[torch.Tensor], torch.Tensor], block_size: int,
                 device: torch.device) -> None:
        self.forward = forward
        self.compute_logits = compute_logits
        self.block_size = block_size
        self.device = device

    def _run(self, parts: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """parts: (token ids, first position, block ids) per request, decodes first -> hidden [T, H]."""
        query_lens = [len(ids) for ids, _, _ in parts]
        seq_lens = [start + len(ids) for ids, start, _ in parts]
        meta = AttentionMetadata.build(query_lens, seq_lens, [blocks for _, _, blocks in parts], self.block_size,
                                       self.device)
        input_ids = torch.tensor([t for ids, _, _ in parts for t in ids], dtype=torch.long, device=self.device)
        positions = torch.tensor([p for ids, start, _ in parts for p in range(start, start + len(ids))],
                                 dtype=torch.long, device=self.device)
        with forward_context(meta):
            return self.forward(input_ids, positions)

    def _sample(self, logits: torch.Tensor, jobs: list[DraftJob]) -> tuple[list[int], list[torch.Tensor | None]]:
        greedy = logits.argmax(dim=1).tolist()
        tokens: list[int] = []
        probs: list[torch.Tensor | None] = []
        for row, job in enumerate(jobs):
            if job.temperature < SAMPLING_EPS:
                tokens.append(greedy[row])
                probs.append(None)
                continue
            p = (logits[row].float() / job.temperature).softmax(dim=0)
            cdf = p.double().cumsum(0)
            u = torch.rand(1, generator=job.generator, device=self.device, dtype=torch.float64)
            token = int(torch.searchsorted(cdf, (1.0 - u) * cdf[-1]).clamp_(max=p.shape[0] - 1))
            tokens.append(token)
            probs.append(p)
        return tokens, probs

    @torch.inference_mode()
    def propose(self, jobs: list[DraftJob]) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Returns drafts per proposing request and, for random ones, their distributions [k, V]."""
        jobs = sorted((j for j in jobs if j.end > j.start), key=lambda j: j.end - j.start != 1)
        if not jobs:
            return {}, {}
        hidden = self._run([(j.token_ids[j.start:j.end], j.start, j.block_ids) for j in jobs])
        last_rows, row = [], -1
        for j in jobs:
            row += j.end - j.start
            last_rows.append(row)
        active = [(j, r) for j, r in zip(jobs, last_rows) if j.num_drafts > 0]
        drafts: dict[str, list[int]] = {j.req_id: [] for j, _ in active}
        probs: dict[str, list[torch.Tensor]] = {}
        step = 0
        while active:
            logits = self.compute_logits(hidden[[r for _, r in active]])
            tokens, step_probs = self._sample(logits, [j for j, _ in active])
            for (job, _), token, p in zip(active, tokens, step_probs):
                drafts[job.req_id].append(token)
                if p is not None:
                    probs.setdefault(job.req_id, []).append(p)
            step += 1
            still = [j for j, _ in active if len(drafts[j.req_id]) < j.num_drafts]
            active = [(j, row) for row, j in enumerate(still)]  # rows of the next one-token pass
            if not active:
                break
            hidden = self._run([([drafts[j.req_id][-1]], j.end + step - 1, j.block_ids) for j, _ in active])
        return drafts, {rid: torch.stack(rows) for rid, rows in probs.items()}


def make_draft_model_drafter(draft_model: Any, block_size: int, device: torch.device) -> ModelDrafter:
    return ModelDrafter(draft_model, draft_model.compute_logits, block_size, device)


def make_layer_skip_drafter(target: Any, num_layers: int, block_size: int, device: torch.device) -> ModelDrafter:
    return ModelDrafter(layer_skip_forward(target, num_layers), target.compute_logits, block_size, device)
