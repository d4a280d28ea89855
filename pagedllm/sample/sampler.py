"""Logits -> next token ids (+ logprobs) for one batch, in one vectorized pass.

The logits go through an ordered list of stages (``sample/stages/``: allowed tokens, logit_bias, min_tokens,
penalties, grammar bitmask, temperature, top-k/top-p, min-p; a model's own rules first where the worker adds
them), each active only when some row needs it (it has a step state in the metadata), then the draw
(``sample/draw.py``: argmax for greedy rows, inverse CDF for random rows, on CPUs by one C++ pass). Returned
logprobs are the model's raw log-softmax, taken before any stage (vLLM's default). Nothing here reads a
value back to the host, so it runs without device syncs on any backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.sample.draw import (
    draw,
    draw_masked,
    masked_draw_kernel,
)
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.stage_base import LogitsStage
from pagedllm.sample.stages import default_stages


@dataclass
class LogprobsTensors:
    """Logprobs for B positions. Column 0 is the chosen (sampled or target) token; 1..k are the top-k.

    token_ids: [B, k+1] int64, logprobs: [B, k+1] float32, ranks: [B] int64 (1-based rank of column 0).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    """sampled_token_ids: [B] int64; logprobs present when any row asked for them."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """logprobs [N, V] (already log-softmaxed), token_ids [N] -> LogprobsTensors with k = num_logprobs."""
    token_ids = token_ids.long()
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    # Rank = 1 + number of tokens strictly more likely; ties share the better rank.
    ranks = (logprobs > chosen).sum(dim=1) + 1
    if num_logprobs > 0:
        top_values, top_ids = logprobs.topk(num_logprobs, dim=1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        values = torch.cat([chosen, top_values], dim=1)
    else:
        ids, values = token_ids.unsqueeze(1), chosen
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)


def compute_logprobs_for_targets(logits: torch.Tensor, target_ids: torch.Tensor,
                                 num_logprobs: int) -> LogprobsTensors:
    """Prompt logprobs: logits [N, V] at N positions, target_ids [N] the actual next tokens.

    Returns column 0 = the target token's logprob, columns 1..num_logprobs = the top tokens.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return _gather_logprobs(logprobs, target_ids, num_logprobs)


def logprob_dicts(lp: LogprobsTensors, ks: list[int]) -> list[dict[int, tuple[float, int]]]:
    """The one way logprob tensors reach the host: one {token_id: (logprob, rank)} per row, the chosen token
    first (its true rank), then the row's top ks[row] (rank = column) unless already there.

    lp: LogprobsTensors of len(ks) rows with at least max(ks) + 1 columns. Three transfers for all rows.
    """
    ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
    out = []
    for row, k in enumerate(ks):
        entry = {ids[row][0]: (vals[row][0], ranks[row])}
        for j in range(1, k + 1):
            entry.setdefault(ids[row][j], (vals[row][j], j))
        out.append(entry)
    return out


class Sampler(nn.Module):
    """Turns a step's logits into token ids: the ordered logits stages, then the draw.

    Does not modify the caller's logits. Every active stage runs on every path: the only shortcuts fuse the
    tail of the active stages into the C++ draw (same result, fewer passes), as the stages declare
    (``draw_fusion``): a last temperature stage, and a grammar bitmask stage right before it (or last), which
    the draw then reads word by word. ``stages``: the runner passes its ``SamplingBatch``'s, the objects that
    keep the requests' state.
    """

    def __init__(self, stages: list[LogitsStage] | None = None) -> None:
        super().__init__()
        self.stages = stages if stages is not None else default_stages()

    def active_stages(self, meta: SamplingMetadata) -> list[LogitsStage]:
        """The stages with a step state this step, in order."""
        steps = meta.steps
        return [stage for stage in self.stages if stage.name in steps]

    def process_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits [N, V] -> a new float32 [N, V] after every active stage except the draw.

        Random rows come out as the logits of the distribution to draw from (temperature applied, masked
        tokens -inf); greedy rows come out so that their argmax is the token greedy picks. ``meta`` is
        row-wise, so several rows may belong to one request (speculative decoding's target positions).
        """
        out = logits.to(torch.float32, copy=True)
        steps = meta.steps
        for stage in self.active_stages(meta):
            out = stage.apply(out, steps[stage.name])
        return out

    def draw(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Processed logits [N, V] (from ``process_logits``) -> [N] int64 token ids. Reads logits only."""
        return draw(logits, meta)

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32 -> SamplerOutput (sampled ids [B], optional logprobs [B, k+1])."""
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        steps = meta.steps
        stages = self.active_stages(meta)
        fused_temperature = None
        if stages and stages[-1].draw_fusion == "temperature":
            # The draw divides by the temperature itself (the C++ kernel in the same pass as the softmax).
            stages, fused_temperature = stages[:-1], steps[stages[-1].name].temperature
        fused_grammar = None
        if stages and stages[-1].draw_fusion == "bitmask" and \
                masked_draw_kernel(logits, copied=len(stages) > 1) is not None:
            # The C++ draw reads the bitmask itself and skips disallowed words: no [N, V] -inf fill.
            stages, fused_grammar = stages[:-1], steps[stages[-1].name]
        # Stages work in place on one private copy; with none active the caller's logits are only read.
        private = bool(stages)
        if private:
            logits = logits.to(torch.float32, copy=True)
        for stage in stages:
            logits = stage.apply(logits, steps[stage.name])
        if fused_grammar is not None:
            sampled = draw_masked(logits, meta, fused_grammar.rows, fused_grammar.bitmask, fused_temperature)
        else:
            sampled = draw(logits, meta, temperature=fused_temperature, private=private)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)
