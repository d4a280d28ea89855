"""The model runner's one handle on speculative decoding: verify this step's drafts, propose the next.

The runner hands over what it knows (its per-request states, the step's logits rows); this class owns
the proposer, the rows-per-position sampling metadata and the rejection rule.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.logger import init_logger
from pagedllm.sample.metadata import build_sampling_metadata
from pagedllm.sample.rejection_sampler import DraftRun, process_target_logits, rejection_sample
from pagedllm.sample.sampler import _gather_logprobs
from pagedllm.sampling_params import SAMPLING_EPS, SamplingParams
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.model_drafter import (
    DraftJob,
    ModelDrafter,
    make_draft_model_drafter,
    make_layer_skip_drafter,
)
from pagedllm.spec_decode.ngram_proposer import NgramProposer

logger = init_logger(__name__)


def can_speculate(params: SamplingParams) -> bool:
    """Requests with structured outputs are not speculated (yet): their grammar would have to advance
    over the drafts and roll back on rejection."""
    return not any(getattr(params, name, None) is not None
                   for name in ("structured_outputs", "guided_decoding", "response_format"))


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, target: Any, draft_model: Any | None, block_size: int,
                 vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.ngram: NgramProposer | None = None
        self.drafter: ModelDrafter | None = None
        if config.method == "ngram":
            self.ngram = NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "layer_skip":
            self.drafter = make_layer_skip_drafter(target, config.num_draft_layers, block_size, device)
        else:
            self.drafter = make_draft_model_drafter(draft_model, block_size, device)
        # Catch-up passes keep a separate draft model's KV cache in step with the target's.
        self.catch_up_all = config.method == "draft_model"
        # req_id -> [k, V] distributions its pending (random) drafts were drawn from.
        self.draft_probs: dict[str, torch.Tensor] = {}

    def forget(self, req_id: str) -> None:
        self.draft_probs.pop(req_id, None)

    # ---- verification ------------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, jobs: list[tuple[Any, list[int], int]]
               ) -> tuple[list[list[int]], list[list[dict[int, tuple[float, int]]] | None]]:
        """logits [N, V]: raw target logits; jobs: (runner state, drafts, first row) per request, each
        owning len(drafts) + 1 consecutive rows. Returns per job its new tokens and, if it asked for
        logprobs, one {token: (logprob, rank)} per new token (raw logprobs, like the Sampler's)."""
        params, outputs, prompts, row_ids = [], [], [], []
        for state, drafts, first_row in jobs:
            for i in range(len(drafts) + 1):
                params.append(state.params)
                # Row i sees the drafts before it as output tokens (penalties, min_tokens).
                outputs.append(state.output_token_ids + drafts[:i])
                prompts.append(state.prompt_token_ids)
                row_ids.append(first_row + i)
        rows = logits[row_ids]
        meta = build_sampling_metadata(params, outputs, prompts, [None] * len(params), self.eos_token_ids,
                                       self.vocab_size, self.device)
        processed = process_target_logits(rows, meta)
        runs, first = [], 0
        for state, drafts, _ in jobs:
            probs = self.draft_probs.pop(state.req_id, None)
            runs.append(DraftRun(first, drafts, state.params.temperature < SAMPLING_EPS,
                                 probs[:len(drafts)] if probs is not None else None, state.generator))
            first += len(drafts) + 1
        tokens = rejection_sample(processed, runs)
        entries: list[list[dict[int, tuple[float, int]]] | None] = [None] * len(jobs)
        if meta.max_num_logprobs is not None:
            raw = torch.log_softmax(rows.float(), dim=-1)
            for j, ((state, _, _), run, new) in enumerate(zip(jobs, runs, tokens)):
                k = state.params.logprobs
                if k is None:
                    continue
                lp = _gather_logprobs(raw[run.first_row:run.first_row + len(new)],
                                      torch.tensor(new, device=self.device), k)
                ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
                entries[j] = [{ids[r][0]: (vals[r][0], ranks[r]),
                               **{ids[r][c]: (vals[r][c], c) for c in range(1, k + 1) if ids[r][c] != ids[r][0]}}
                              for r in range(len(new))]
        return tokens, entries

    # ---- proposing ---------------------------------------------------------------------------------
    def _room(self, state: Any) -> int:
        """Drafts worth making for a request: none past max_tokens, and for a model drafter none whose
        K/V would fall outside the request's blocks (its lookahead slots)."""
        room = self.k
        if state.params.max_tokens is not None:
            room = min(room, state.params.max_tokens - len(state.output_token_ids) - 1)
        if self.drafter is not None:
            room = min(room, len(state.block_ids[0]) * self.block_size - len(state.token_ids) + 1)
        return max(room, 0)

    def propose(self, states: list[Any], starts: list[int], query_lens: list[int], sampled: set[str]
                ) -> dict[str, list[int]]:
        """After the step: drafts for the requests that got new tokens (``sampled``).

        ``starts[i]``/``query_lens[i]``: where request i's computed tokens began this step and how many
        were scheduled (states already hold the accepted tokens)."""
        enabled = self.config.disable_by_batch_size is None or len(states) <= self.config.disable_by_batch_size
        if self.ngram is not None:
            if not enabled:
                return {}
            out = {}
            for state in states:
                if state.req_id in sampled and can_speculate(state.params):
                    drafts = self.ngram.propose(state.token_ids, self._room(state))
                    if drafts:
                        out[state.req_id] = drafts
            return out
        jobs = []
        for state, start, q in zip(states, starts, query_lens):
            proposing = enabled and state.req_id in sampled and can_speculate(state.params)
            num = self._room(state) if proposing else 0
            capacity = len(state.block_ids[0]) * self.block_size
            if self.catch_up_all:
                end = min(len(state.token_ids) if state.req_id in sampled else start + q, capacity)
                begin = start
            else:
                end = len(state.token_ids)
                begin = end - 1
            if end < len(state.token_ids):
                num = 0  # its newest token has no slot yet: catch up now, propose next step
            if num == 0 and not self.catch_up_all:
                continue
            jobs.append(DraftJob(state.req_id, state.token_ids, state.block_ids[0], begin, end, num,
                                 state.params.temperature, state.generator))
        drafts, probs = self.drafter.propose(jobs)
        self.draft_probs.update(probs)
        return {rid: d for rid, d in drafts.items() if d}
